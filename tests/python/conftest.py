"""Every test must leave the stash empty and no frame open: a leaked record or frame is a bug."""
import pytest

import attnstash
from attnstash import ops


@pytest.fixture(autouse=True)
def stash_is_empty_after_each_test():
    yield
    depth = ops.frame_depth()
    for _ in range(depth):
        ops.frame_close(False)
    if depth:
        pytest.fail(f"the test left {depth} frame(s) open on its thread")
    from attnstash.install import compiled
    if compiled.open_frames():
        pytest.fail(f"the test left {compiled.open_frames()} compiled frame(s) open on its thread")
    held = attnstash.stash_stats()
    if held["records"] or held["bytes"]:
        attnstash.stash_clear()
        pytest.fail(f"the test left records in the stash: {held}")


@pytest.fixture
def installed():
    """install_attention_stash through this, so that every test ends with the stash uninstalled
    (a test may uninstall a model itself)."""
    models = []

    def install(model, n=None, **kwargs):
        layers = attnstash.install_attention_stash(model, n, **kwargs)
        models.append(model)
        return layers

    yield install
    for model in models:
        try:
            attnstash.uninstall_attention_stash(model)
        except ValueError:
            pass  # the test uninstalled it itself
