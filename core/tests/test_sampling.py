"""Samples carry the weight version of every token; a sample read from the wire (the rollout
router's answer) whose versions do not fit its tokens is refused, never guessed."""

from __future__ import annotations

import pytest

from weightsync.interfaces.sampling import Sample


def _sample(**kw: object) -> Sample:
    base: dict = {"token_ids": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5], "finish_reason": "length",
                  "engine": "e", "version": 3, "version_end": 4, "token_versions": [3, 4, 4]}
    return Sample(**{**base, **kw})


def test_token_versions_travel_and_say_each_tokens_version() -> None:
    s = _sample(stale_kv=True)
    back = Sample.from_json(s.to_json())
    assert back == s and back.versions() == [3, 4, 4] and back.mixed and back.stale_kv
    # an engine that reports no per-token version: one version is every token's, a mix is unknown
    assert _sample(version_end=3, token_versions=[]).versions() == [3, 3, 3]
    assert _sample(token_versions=[]).versions() is None


@pytest.mark.parametrize("versions", [[3, 4], [4, 4, 4], [3, 3, 3]])
def test_token_versions_that_do_not_fit_are_refused(versions: list[int]) -> None:
    with pytest.raises(ValueError, match="token_versions do not fit its 3 tokens of versions 3..4"):
        Sample.from_json(_sample(token_versions=versions).to_json())
