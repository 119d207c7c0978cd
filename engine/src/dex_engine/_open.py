"""Opening a store from a URL."""

from __future__ import annotations

import re
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import unquote

from ._errors import StoreOpenError, shown

if TYPE_CHECKING:  # _store names URLs as shown_url shows them
    from ._store import Store

# What a PostgreSQL URL needs installed beyond the engine itself.
POSTGRES_EXTRA_MODULES = ("psycopg", "psycopg_pool")
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(url: str, *, existing: bool = False) -> Store:
    """Open the database at `url`: `sqlite:///path/to/file.db` (optionally `?synchronous=NORMAL`)
    or `postgresql://user@host:port/dbname` (needs the `postgres` extra). It creates the database's
    schema, or migrates an older one, as it opens.

    With `existing`, only an engine database of this dex_engine's schema is opened, to read or
    operate the one the workers use: a SQLite file that is not there raises FileNotFoundError, and
    a database without dex_engine tables or of an older schema StoreOpenError, before anything is
    created or changed."""
    given: object = url  # typed str; checked for callers that pass anything
    if not isinstance(given, str):
        raise ValueError(f"database URL must be a str, got {type(given).__name__}: {shown_url_value(given)}; "
                         "pass its text, such as str(url) for a URL object")
    if "\x00" in url:
        # A file path cannot hold one, and libpq ends a parameter at it: the rest would name another
        # database.
        raise ValueError(f"database URL {shown_url(url)!r} has a NUL character; remove it")
    if existing:
        from ._existing import OPEN_EXISTING, check_existing  # it imports this module

        check_existing(url, OPEN_EXISTING, must_exist=True)
    if url.startswith("sqlite:"):
        from ._sqlite_store import SqliteStore

        return SqliteStore(url)
    if url.startswith(POSTGRES_SCHEMES):
        store: Store = postgres_store_module(url).PostgresStore(url)
        return store
    raise ValueError(
        f"unsupported database URL {shown_url(url)!r}; use sqlite:///path/to/file.db or postgresql://user@host:port/dbname"
    )


def postgres_store_module(url: str) -> ModuleType:
    """The PostgreSQL store's module; StoreOpenError naming the extra to install when its driver is missing."""
    try:
        from . import _pg_store
    except ModuleNotFoundError as exc:
        if exc.name not in POSTGRES_EXTRA_MODULES:
            raise
        raise StoreOpenError(
            f"cannot open {shown_url(url)!r}: PostgreSQL needs the {exc.name} package, which is not installed; "
            "install the engine's postgres extra (dex-engine is not on PyPI: from a clone of dex, "
            "pip install './engine[postgres]')"
        ) from None
    return _pg_store


def shown_url(url: str) -> str:
    """`url` fit for a message or a log: a password in it, as user:password@, a password= or
    sslpassword= parameter (any case) or a libpq keyword string's password=..., is written as ***. By pattern,
    not parsed: a malformed URL is shown too."""
    url = _USERINFO_PASSWORD.sub(r"\1:***@", url, count=1)
    url = _PASSWORD_PARAMETER.sub(r"\1\2password=***", url)
    return _KEYWORD_PASSWORD.sub(r"\1\2password=***", url)


def shown_url_value(value: object) -> str:
    """repr(value), a database URL given as something other than a str, fit for the refusal that
    names it: a pydantic PostgresDsn (from a settings class), a yarl URL or bytes repr as the whole
    URL, password and all; its password is written as *** as shown_url writes it."""
    try:
        text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes | bytearray) else str(value)
    except Exception:  # no text to find its password in: its repr may show it, so the type alone
        try:
            repr(value)
        except Exception:  # no repr either: shown() names it as it names every such value, showing nothing of it
            return shown(value, None)
        return f"(a {type(value).__name__} whose text could not be made)"
    return shown_error(shown(value, None), text)


def shown_error(text: str, url: str) -> str:
    """`text`, a driver's error about `url`, fit for a message or a log: the URL as shown_url
    shows it, and each piece of its password libpq may quote on its own written as ***: the whole
    password (a bad %-escape in it), and, around an unescaped '@' in it, what comes before it, which
    libpq takes for the password (and quotes for a bad %-escape in it), and what follows it, which
    libpq takes for the host name. Only where no letter, digit, '%', '.' or '-' touches the piece,
    so that a short password does not blank out every word holding its characters."""
    text = text.replace(url, shown_url(url))
    pieces: set[str] = set()
    userinfo = _USERINFO_PASSWORD.match(url)
    if userinfo is not None:
        password = url[userinfo.end(1) + 1:userinfo.end() - 1]
        before, _, after = password.partition("@")
        pieces.update((password, before, after))
    pieces.update(found.group(1) for found in _PASSWORD_VALUE.finditer(url))
    pieces.update([unquote(piece) for piece in pieces])
    for piece in sorted(pieces - {""}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w%.-]){re.escape(piece)}(?![\w%.-])", "***", text)
    return text


# From the user name's ':' to the URL's last '@': a password with an unescaped '@', '?', '#' or '/'
# (libpq reads the first three as part of it) is hidden whole. Not a host's ':port' (digits, then the
# end, or the path or the next host with no '@' before the parameters) before an '@' in a parameter's
# value. libpq takes the text up to the first '@' before any '/' as user:password, so digits followed
# by '?', '#', or a ',' or '/' with an '@' before the parameters, are a password ("12?ab", "12,34"),
# never a port. A URL with a password and an '@' in a parameter's value shows less than it could, and
# one with an '@' in its database name too, never a password. Leading blanks (a URL read from a
# file or an environment variable) or a slash too few after the scheme do not hide it from the pattern.
_USERINFO_PASSWORD = re.compile(r"^(\s*[a-zA-Z][\w+.-]*:/*[^:@/?#]*):(?!\d*(?:$|[/,][^@?#]*(?:[?#]|$))).*@")
# And sslpassword, the passphrase of the client certificate's key. Any case: libpq refuses
# ?PASSWORD=, but the user meant one.
_PASSWORD_PARAMETER = re.compile(r"([?&])(ssl)?password=[^&#]*", re.IGNORECASE)
_PASSWORD_VALUE = re.compile(r"[?&](?:ssl)?password=([^&#]*)", re.IGNORECASE)
# A libpq keyword string ("host=db password='a b' dbname=app"), which open_store refuses: its
# password, quoted or not, is not shown in that refusal either.
_KEYWORD_PASSWORD = re.compile(r"(^|\s)(ssl)?password\s*=\s*(?:'(?:[^'\\]|\\.)*'?|\S*)", re.IGNORECASE)
