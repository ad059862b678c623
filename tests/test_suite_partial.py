"""The suite keeps what a long phase finished when its world's job is ended by the timeout: the report
says the phase is partial and still shows it."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


def _results(partial: bool) -> dict:
    entry = {"world_size": 2, "status": "ok", "variants": ["plain"], "rounds": 1, "steps": 1, "precision": "fp32",
             "models": {}}
    if partial:
        entry["partial"] = True
    return {"card": "cpu", "torch": "x", "python": "3", "world_sizes": [2], "created": "now", "smoke": True,
            "phases": {"models": {"status": "ok", "worlds": {"2": entry}}}}


def test_a_partial_phase_is_named_in_the_report():
    from report import render_markdown

    assert "models, world 2: **partial**" in render_markdown(_results(True))
    assert "partial" not in render_markdown(_results(False))


def test_the_models_phase_saves_after_each_model(monkeypatch):
    """models.run hands what it has to `save_partial` after every model, before the next one starts."""
    import types

    import torch
    from phases import models

    saved = []
    monkeypatch.setattr(models, "NEEDS", {"a": None, "b": None})
    monkeypatch.setattr(models, "measure", lambda name, *a, **k: {"model": name})
    opts = types.SimpleNamespace(variants="plain", rounds=1, steps=1, smoke=True, third_party="a,b",
                                 save_partial=lambda phase, result: saved.append((phase, dict(result["models"]))))
    ctx = types.SimpleNamespace(device=torch.device("cpu"))
    result = models.run(ctx, opts)
    assert saved == [("models", {"a": {"model": "a"}}), ("models", {"a": {"model": "a"}, "b": {"model": "b"}})]
    assert result["models"] == saved[-1][1]
