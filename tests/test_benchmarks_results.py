"""benchmarks: a partial run saves over the full results without losing what it did not measure."""

from benchmarks.__main__ import keep_unmeasured


def test_a_partial_run_keeps_the_models_and_parts_it_did_not_measure() -> None:
    earlier = {
        "started": "monday",
        "measured": {"timing": "monday", "memory": "sunday"},
        "overhead": {"overhead": 7e-5},
        "models": {
            "mlp": {"description": "MLP", "timing": {"ratio": 0.8}, "rss": {"ort": 1}},
            "cnn": {"description": "CNN", "timing": {"ratio": 0.9}, "rss": {"ort": 2}},
            "transformer": {"description": "encoder", "timing": {"ratio": 0.6}, "measured": "saturday"},
        },
    }
    # `--models cnn --parts timing`: only the CNN's step times were measured
    results = {"started": "tuesday", "models": {"cnn": {"description": "CNN", "timing": {"ratio": 0.85}}}}
    keep_unmeasured(results, earlier, {"timing"})

    assert list(results["models"]) == ["mlp", "cnn", "transformer"]
    cnn = results["models"]["cnn"]
    assert cnn["timing"] == {"ratio": 0.85} and cnn["rss"] == {"ort": 2} and cnn["measured"] == "tuesday"
    assert results["models"]["mlp"] == {"measured": "monday", **earlier["models"]["mlp"]}
    assert results["models"]["transformer"]["measured"] == "saturday"  # carried twice: still its own run's
    assert results["overhead"] == earlier["overhead"]
    assert results["measured"]["timing"] == "tuesday" and results["measured"]["memory"] == "sunday"
