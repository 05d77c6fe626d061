"""Every test must leave the stash empty: a leaked entry is a bug."""
import pytest

import attnstash


@pytest.fixture(autouse=True)
def stash_is_empty_after_each_test():
    yield
    held = attnstash.stash_stats()
    if held["entries"] or held["bytes"]:
        attnstash.stash_clear()
        pytest.fail(f"the test left entries in the stash: {held}")
