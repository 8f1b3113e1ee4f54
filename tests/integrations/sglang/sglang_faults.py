"""Builds made to fail, for the SGLang adapter's fallback tests (fake and real SGLang alike)."""

import logging


def failing(monkeypatch, obj, name, errors):
    """``obj.name`` raises ``errors`` in turn (one a call), then runs as it was."""
    real, pending = getattr(obj, name), list(errors)

    def call(*args, **kwargs):
        if pending:
            raise pending.pop(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, call)


def chunkmeta_warnings(caplog) -> list[str]:
    """The messages of the warnings chunkmeta's loggers gave."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("chunkmeta")]
