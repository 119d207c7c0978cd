"""Every limit, default and fixed text of the session, each with the reason for its value."""

from __future__ import annotations

from datetime import timedelta

from dex_engine import MAX_VALUE_NESTING

# Upper bound of Channel ranges (TurnControlRequests, SteeredUserMessages): "everything queued".
MAX = 2_147_483_647

# RunModel: a model call may stream for minutes; 15 min bounds a stuck provider connection.
RUN_MODEL_TIMEOUT = timedelta(minutes=15)
# A RunModel attempt heartbeats every RUN_MODEL_HEARTBEAT_INTERVAL; missing several means a stuck Worker.
RUN_MODEL_HEARTBEAT_TIMEOUT = timedelta(minutes=2)
RUN_MODEL_HEARTBEAT_INTERVAL = timedelta(seconds=20)
# Three attempts within 30 minutes ride out a provider blip without looping on a broken request.
RUN_MODEL_MAX_ATTEMPTS = 3
RUN_MODEL_RETRY_BUDGET = timedelta(minutes=30)

# read and idempotent_write tool calls may run again, so CallTool retries them.
CALL_TOOL_MAX_ATTEMPTS = 3
# A write that is not idempotent runs at most once.
CALL_SINGLE_ATTEMPT_TOOL_MAX_ATTEMPTS = 1
# Tool Steps heartbeat in the background as RunModel does, so a long tool is not taken for dead.
TOOL_HEARTBEAT_INTERVAL = RUN_MODEL_HEARTBEAT_INTERVAL

# Tool tasks: a poll only reads the task, so PollToolTask retries as CallTool does. Dex Timers take
# whole seconds; the interval is clamped to at least a second and at most a day between polls.
POLL_TOOL_TASK_MAX_ATTEMPTS = 3
MIN_TOOL_TASK_POLL_INTERVAL_SECONDS = 1
MAX_TOOL_TASK_POLL_INTERVAL_SECONDS = 86_400
# CancelToolTask is best-effort: a cancellation that keeps failing must still end the turn soon.
CANCEL_TOOL_TASK_TIMEOUT = timedelta(seconds=30)
CANCEL_TOOL_TASK_MAX_ATTEMPTS = 3
CANCEL_TOOL_TASK_RETRY_BUDGET = timedelta(minutes=2)

# The AgentEvents Stream keeps the newest 10 MiB of events per session; clients rebuild from snapshots.
DEFAULT_AGENT_EVENTS_CAPACITY_BYTES = 10 * 1024 * 1024
# The largest AgentEvents capacity: what the engine's Stream takes (a 64-bit count), checked before
# the Stream is built so that a bad one names the option rather than the Stream.
MAX_AGENT_EVENTS_CAPACITY_BYTES = 2**63 - 1

# The built-in loop's parsed input items, kept per process by stored message: each model call reads
# the whole conversation again, and a stored message never changes. Room for many sessions' windows.
INPUT_ITEM_CACHE_ENTRIES = 8192
# And at most so many characters of those messages' texts, as the engine's decoded cache bounds its
# bytes: a worker's tool outputs of 100 kB each otherwise kept 800 MB alive here.
INPUT_ITEM_CACHE_CHARS = 32 * 1024 * 1024

# The messages of each session's chunks, as its last model call assembled them, kept per process
# (_chunk_memo): for many more sessions than a worker runs at once, and at most so many messages in
# all, since the memo holds chunks the engine's decoded cache may since have let go (about 20 MiB at a
# few hundred bytes a message).
CHUNK_MEMO_SESSIONS = 256
CHUNK_MEMO_MESSAGES = 65_536
# And at most so many characters of those messages' texts: at 100 kB tool outputs, the message bound
# alone let it keep gigabytes.
CHUNK_MEMO_CHARS = 64 * 1024 * 1024

# get_agent_snapshot returns the newest messages only; list_agent_messages pages through the rest.
SNAPSHOT_MESSAGE_LIMIT = 200
LIST_MESSAGES_DEFAULT_LIMIT = 50
LIST_MESSAGES_MAX_LIMIT = 200

# Message storage (seed 002 "Message storage"): window and chunk sizes keep each value small.
DEFAULT_MESSAGE_WINDOW_SIZE = 64
DEFAULT_MESSAGE_CHUNK_SIZE = 32
DEFAULT_MESSAGE_CHUNK_MAX_BYTES = 1024 * 1024
MAX_MESSAGE_CHUNK_MAX_BYTES = 8 * 1024 * 1024
MESSAGE_ROLLOVER_MAX_CHUNKS_PER_COMMIT = 4
MESSAGE_ROLLOVER_MAX_BYTES_PER_COMMIT = 8 * 1024 * 1024
DEFAULT_RETAINED_MESSAGE_LIMIT = 1000

# Session settings are references the Worker resolves, never content; 16 KiB is plenty.
MAX_SESSION_SETTINGS_BYTES = 16_384
# Levels of objects and arrays in session settings: the engine's MAX_VALUE_NESTING, less room for
# the values they travel in (the start input, the turn's copy, an update request).
MAX_SESSION_SETTINGS_NESTING = MAX_VALUE_NESTING - 10
# Cores encode some floats and U+2028/U+2029 differently; the session accepts this much more.
SESSION_SETTINGS_SIZE_TOLERANCE_BYTES = 1_024

# A durable_wait may last up to a year by default; Timers hold no Worker.
DEFAULT_MAX_DURABLE_WAIT = timedelta(days=365)

# AgentSessionClient retries RpcLockConflictError while one Step holds the lock this long: the locks are
# held only by short Steps (a new holder, one of a train of Steps, starts the time again).
RPC_LOCK_CONFLICT_RETRY = timedelta(seconds=5)
# The first retry after a holder's conflict comes soon, as a short Step's commit frees the lock within
# milliseconds (a 20 ms first wait made each approval of a fan-out take 24 ms on SQLite); each further
# retry waits twice as long, up to the longest interval.
RPC_LOCK_CONFLICT_FIRST_RETRY_INTERVAL = timedelta(milliseconds=1)
RPC_LOCK_CONFLICT_LONGEST_RETRY_INTERVAL = timedelta(milliseconds=20)
# resolve_interrupt and answer_question read a lock-free snapshot (to return False without waiting
# for the lock) only once their conflicts have lasted this long: a snapshot holds every pending
# interrupt, and a conflict with one short Step ends sooner.
RPC_LOCK_CONFLICT_REFUSED_CHECK_AFTER = timedelta(milliseconds=20)

# The built-in loop's limit on decide_turn_continuation continuations in a row.
MAX_CONSECUTIVE_TURN_CONTINUATIONS = 8
# Finish reasons (ModelCallMetadata.finish_reasons, compared in lower case) that say a model's output
# was cut at its output token limit: Chat Completions' "length" (LiteLLM's mapping of Anthropic's and
# Gemini's too), the Responses API's incomplete reason "max_output_tokens", and Anthropic's and
# Gemini's own "max_tokens". The built-in loop tells the model and the user, instead of taking a cut
# answer as whole, or a cut tool call as one that merely had bad arguments.
TOKEN_LIMIT_FINISH_REASONS = frozenset({"length", "max_output_tokens", "max_tokens"})
# Finish reasons that say the provider's content filter stopped the model's output (Chat Completions'
# and the Responses API's incomplete reason): what was written before is all the answer there is.
CONTENT_FILTER_FINISH_REASONS = frozenset({"content_filter"})

# Fixed texts the model and operators see.
TOOL_CALL_NOT_RUN_ERROR_PREFIX = "the tool did not run, so it is safe to call again"
# The error of a call cancel_turn or a steer ended while its CallTool waited for a retry (the
# failure route records it by effect, its last attempt's error after this).
CANCELLED_WHILE_WAITING_TO_RETRY = "cancelled while waiting to retry: the user cancelled the turn"
STEERED_WHILE_WAITING_TO_RETRY = "cancelled while waiting to retry: the user steered the turn with a new message"
MISSING_TOOL_TASK_POLLER = (
    "the tool started a task, but the runner does not implement poll_tool_task, so nothing can poll it"
)
# CancelToolTask (and its failure route) records a task that cancel_turn abandoned with this error.
TOOL_TASK_CANCELLED_ERROR = "the turn was cancelled while the tool's task was running; the task may have taken effect"
APPROVAL_DEADLINE_PASSED = "approval deadline passed"
QUESTION_DEADLINE_PASSED = "question deadline passed"
DEFAULT_REJECTION_MESSAGE = "The user rejected this tool call."
DEFAULT_DECLINE_MESSAGE = "The user declined to answer."
# A person's reason for a rejection or decline is kept up to this many characters: it is stored
# with the call's record (one engine value, 1 MiB) and shown to the model, and a longer one would
# fail that Step on every retry, and the session with it.
MAX_REJECTION_MESSAGE_CHARS = 16_384
# The rejection message a call gets when even a cut one does not fit beside its arguments.
REJECTION_MESSAGE_NOT_STORED = "The user rejected this tool call; the reason given was too large to store."
# A tool's error text (ToolExecutionError, ToolOutcomeUnknownError) too large to store with its call
# is kept to this many characters, and the call keeps its status: a write whose outcome is unknown
# must go on saying so, whatever the size of what the tool said.
MAX_STORED_TOOL_ERROR_CHARS = 4000
# The largest token count a runner's AgentUsage may report: a 64-bit count, what providers and the
# engine's other counters use; a count past Python's 4,300 digits could not even be stored.
MAX_USAGE_COUNT = 2**63 - 1
# The largest CompactionPolicy.context_window_tokens: a 64-bit count, as MAX_USAGE_COUNT; a larger
# window overflows the float arithmetic of its trigger, failing every model call instead of the policy.
MAX_CONTEXT_WINDOW_TOKENS = 2**63 - 1
# The most attempts RunModelLimit takes: what the engine's RetryPolicy takes, a 64-bit count.
MAX_RETRY_ATTEMPTS = 2**63 - 1
# A failed turn's error (last_turn_error, the turn_failed event) is kept to this many characters:
# a runner's turn_error or a raised text of megabytes could not be stored, and the model call would
# run again on every retry, the runner's messages lost.
MAX_STORED_TURN_ERROR_CHARS = 4000
# A note listing a turn's tool calls that is too large to store whole keeps this many characters of
# each call's arguments and result: the calls and their statuses still reach the model, so a write
# that ran is not repeated, while a few hundred calls still fit one engine value.
CUT_NOTE_FIELD_CHARS = 2_000
# When even that note is too large (a failed turn of hundreds of calls with long arguments), it is
# cut again to these: the calls' names and statuses are what keep the next turn's model from
# repeating a write, and at 0 several thousand calls fit one engine value.
TIGHTER_NOTE_FIELD_CHARS = (200, 0)
# Steering and cancel_turn record a call they abandoned before it started rejected with one of these
# (seed 002, "Turn-failure note and model-visible results"), compact JSON the model can read.
STEERED_REJECTION_MESSAGE = '{"status":"cancelled","reason":"superseded_by_steered_user_message"}'
TURN_CANCELLED_REJECTION_MESSAGE = '{"status":"cancelled","reason":"turn_cancelled_by_user"}'
ARGUMENTS_NOT_OBJECT = "arguments must be a JSON object"
# A call whose tool name is blank (a model's malformed output) fails with this, the model seeing it.
TOOL_NAME_MISSING = "the tool call names no tool"
# Arguments nested deeper than Python's JSON decoder can go (its recursion limit): the call fails
# with this rather than the model call raising RecursionError on every attempt.
ARGUMENTS_TOO_DEEP = "arguments are nested too deeply to read as JSON"
# Characters of a value the model wrote that a built-in's error repeats: enough to recognise it,
# and the error (stored in the call's record) stays small whatever the model sent.
SHOWN_VALUE_CHARS = 60
# A built-in call whose JSON escapes decode to a lone surrogate: text that cannot be stored.
ARGUMENTS_NOT_TEXT = "arguments hold a \\u escape of half a UTF-16 pair (a lone surrogate), which is not text"
NEW_MESSAGES_WITHOUT_BUILDER = (
    "a runner that sets ToolCallsRequested.new_messages must implement build_unfinished_turn_messages"
)
INVALID_START_SESSION_SETTINGS_REASON = (
    "dex-agents: the start input's session_settings are not valid session settings"
)
# Plans (seed 002 "Rules" and "Turn-failure note and model-visible results").
WRITE_TODOS_CALLED_MORE_THAN_ONCE = "write_todos was called more than once in one response"
PLANNING_TURN_REJECTION_MESSAGE = "The tool call was not run: a planning turn can only call write_todos."
# Compaction (seed 003 "Compaction"): the defaults of CompactionPolicy and the texts a model sees.
DEFAULT_COMPACTION_TRIGGER_RATIO = 0.85  # compact when the next input reaches 85% of the window
DEFAULT_COMPACTION_RETAINED_RATIO = 0.3  # keep the newest 30% of the window unsummarized
CONTEXT_SUMMARY_NOTE_HEADER = "[Dex] Summary of the earlier conversation:"
CONTEXT_SUMMARY_TRANSCRIPT_HEADER = (
    "[Dex] Summarize the conversation transcript below. Your summary replaces these messages in the "
    "conversation, so keep everything needed to continue it."
)
CONTEXT_SUMMARY_INSTRUCTIONS = (
    "You write the summary that replaces the earlier part of a conversation between a user and an AI "
    "assistant, including its tool calls and their results. The assistant continues the conversation from "
    "your summary alone. Keep the user's goals, preferences and instructions; facts, decisions, names, "
    "identifiers and numbers; the tool calls that ran and what they returned or changed, so none is "
    "repeated by mistake; and any open question or unfinished work. When the conversation starts with an "
    "earlier summary, fold it in. Write plain text with no preamble."
)
# The last input item of a built-in loop summary request, so the request ends with a user message.
CONTEXT_SUMMARY_REQUEST_TEXT = "[Dex] Write the summary of the conversation above now."

# LiteLLMModelClient hides a credential-named environment value (or LiteLLM key setting, or extra header)
# that a provider error quotes; a shorter one is a setting ("true", "1"): hidden, it would garble the error.
MIN_HIDDEN_ENVIRONMENT_SECRET_CHARS = 8

# Step types of the session Flow (wire contracts: history, search and UIs read them).
START_AGENT_SESSION = "StartAgentSession"
AWAIT_USER_MESSAGE = "AwaitUserMessage"
RUN_MODEL = "RunModel"
AWAIT_TOOL_APPROVAL = "AwaitToolApproval"
CALL_TOOL = "CallTool"
CALL_SINGLE_ATTEMPT_TOOL = "CallSingleAttemptTool"
TOOL_STEPS = (CALL_TOOL, CALL_SINGLE_ATTEMPT_TOOL)  # the Steps that run a call's tool
RECORD_TOOL_FAILURE = "RecordToolFailure"
RECORD_TOOL_OUTCOME_UNKNOWN = "RecordToolOutcomeUnknown"
RESUME_TURN = "ResumeTurn"
RECORD_TURN_FAILURE = "RecordTurnFailure"
AWAIT_QUESTION_ANSWER = "AwaitQuestionAnswer"
AWAIT_TIMER = "AwaitTimer"
POLL_TOOL_TASK = "PollToolTask"
CANCEL_TOOL_TASK = "CancelToolTask"
FINISH_TURN_CANCELLATION = "FinishTurnCancellation"
APPLY_TURN_CONTROL = "ApplyTurnControl"
COMPACT_CONTEXT = "CompactContext"
