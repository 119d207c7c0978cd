"""The demo agent, `dex-agents demo` and `dex-agents chat`: the built-in loop with no model key."""

from ._agent import DEMO_FLOW_TYPE, build_demo_flow, read_ledger
from ._model import HELP_TEXT, demo_model, demo_reply

__all__ = ["DEMO_FLOW_TYPE", "HELP_TEXT", "build_demo_flow", "demo_model", "demo_reply", "read_ledger"]
