"""Backend errors into omnikv errors: one declared table per backend, applied by one helper.

Every backend declares an :class:`ErrorMap` next to the code that calls it (the Transfer
Engine in :mod:`omnikv.connectors.mooncake_te.engine`, the Store in
:mod:`omnikv.connectors.mooncake_store.connector`, NIXL in :mod:`omnikv.connectors.nixl.agent`,
the pull connectors' control sockets in :mod:`omnikv.connectors.pull.control`). A table says
which backend exception types, and which of its return codes, become which
:class:`~omnikv.errors.ConnectorError` subclass; whether a retry may help (``transient``) is the
omnikv class's (see :mod:`omnikv.errors`). Every connector names its table as
``error_map`` (:class:`~omnikv.connectors.base.OmniConnectorBase`), so a test can walk every
exception a backend module exposes and check that none escapes as itself.

The helper: ``with table.translate("get of k"):`` around backend calls raises the mapped
omnikv error ``from`` the backend's, and lets omnikv's own errors through unchanged;
``table.check(rc, "put_from of k")`` raises for a non-zero return code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from omnikv.errors import ConnectorError, ConnectorUnavailableError, OmniKVError

__all__ = ["CodeRule", "ErrorMap", "ErrorRule"]


@dataclass(frozen=True)
class ErrorRule:
    """One row of a table: a backend exception of type ``raised`` (or a subclass) becomes
    ``becomes``; ``meaning`` (optional) says in the message what it means for omnikv."""

    raised: type[BaseException]
    becomes: type[ConnectorError]
    meaning: str = ""

    @property
    def transient(self) -> bool:
        """Whether the sender's put loop retries the resulting error (its class says)."""
        return self.becomes.transient


@dataclass(frozen=True)
class CodeRule:
    """One row for a return code: ``code`` becomes ``becomes``; ``meaning`` names the code."""

    code: int
    becomes: type[ConnectorError]
    meaning: str = ""

    @property
    def transient(self) -> bool:
        return self.becomes.transient


@dataclass(frozen=True)
class ErrorMap:
    """How one backend's failures become omnikv errors.

    ``exceptions`` is searched in order (the first row whose type matches wins, so a subclass
    with its own row comes before its base); ``codes`` name particular return codes, and any
    other non-zero code becomes ``other_codes``. Immutable; built once per backend.
    """

    backend: str
    exceptions: tuple[ErrorRule, ...]
    codes: tuple[CodeRule, ...] = ()
    other_codes: type[ConnectorError] = ConnectorUnavailableError

    @property
    def handled(self) -> tuple[type[BaseException], ...]:
        """Every exception type the table maps (for an ``except`` that only logs)."""
        return tuple(rule.raised for rule in self.exceptions)

    def rule_for(self, exc: BaseException) -> ErrorRule | None:
        """The row ``exc`` falls under, or ``None`` when the table does not map it."""
        for rule in self.exceptions:
            if isinstance(exc, rule.raised):
                return rule
        return None

    def _message(self, rule: ErrorRule, exc: BaseException, what: str) -> str:
        how = rule.meaning or "failed"
        return f"{what}: {self.backend} {how}: {type(exc).__name__}: {exc}"

    @contextlib.contextmanager
    def translate(self, what: str) -> Iterator[None]:
        """Raise the mapped omnikv error (``from`` the original) for a backend exception raised
        inside; omnikv's own errors and exceptions the table does not name pass unchanged."""
        try:
            yield
        except OmniKVError:
            raise
        except BaseException as exc:
            rule = self.rule_for(exc)
            if rule is None:
                raise
            # raised without a local name: a local holding it would make a cycle through its
            # traceback and keep every frame below (and the backend objects they hold) alive
            raise rule.becomes(self._message(rule, exc, what)) from exc

    def code_rule(self, rc: int) -> CodeRule | None:
        """The row naming the return code ``rc``, or ``None``."""
        for rule in self.codes:
            if rule.code == rc:
                return rule
        return None

    def check(self, rc: int, what: str) -> None:
        """Nothing for ``rc == 0``; else raise the error the table gives ``rc`` (a named code's
        class, or ``other_codes``), saying that ``what`` returned it."""
        if rc == 0:
            return
        rule = self.code_rule(rc)
        becomes = self.other_codes if rule is None else rule.becomes
        meaning = f" ({rule.meaning})" if rule is not None and rule.meaning else ""
        raise becomes(f"{what} returned {rc}{meaning}")
