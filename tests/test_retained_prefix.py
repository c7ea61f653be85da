"""The prefix a single program keeps for a later prompt (runtime/retained_prefix.py), rule by rule."""

from __future__ import annotations

import numpy as np

from qeff_vision.runtime.retained_prefix import HeldPrefix, Resume, image_set_resume, resume_point

RING = ["past_key.0"]  # a cache that cannot be rolled back (a sliding-window ring)


def _held(tokens, keys=(), prompt_len=None, at_prompt_end=None) -> HeldPrefix:
    tokens = np.array(tokens, np.int64)
    past = {"past_key.0": np.full(2, 7.0), "past_key.1": np.ones(2)}
    return HeldPrefix(tokens, tuple(keys), prompt_len or len(tokens), past, at_prompt_end)


def test_nothing_held_starts_at_zero():
    assert resume_point(None, np.arange(5), [], [], []) == Resume()


def test_the_longest_common_prefix_is_kept_with_the_held_caches():
    held = _held([1, 2, 3, 4, 5, 6], prompt_len=4)
    resume = resume_point(held, np.array([1, 2, 3, 9, 9, 9, 9]), [], [], [])
    assert (resume.start, resume.images) == (3, 0)
    assert set(resume.restore) == {"past_key.0", "past_key.1"}


def test_at_least_one_token_is_left_to_prefill():
    held = _held([1, 2, 3, 4])
    assert resume_point(held, np.array([1, 2, 3]), [], [], []).start == 2


def test_an_image_cut_or_changed_is_prefilled_again():
    held = _held([1, 5, 5, 5, 2, 5, 5, 3, 4], keys=("a", "b"))
    spans = [(1, 4), (5, 7)]
    # Both images the same, the prefix ends after them: both kept.
    resume = resume_point(held, np.array([1, 5, 5, 5, 2, 5, 5, 3, 8, 8]), spans, ["a", "b"], [])
    assert (resume.start, resume.images) == (8, 2)
    # The second image has other pixels (same placeholder ids): the prefix stops at its start.
    resume = resume_point(held, np.array([1, 5, 5, 5, 2, 5, 5, 3, 8, 8]), spans, ["a", "c"], [])
    assert (resume.start, resume.images) == (5, 1)
    # The tokens differ inside the second image's span: never cut an image.
    resume = resume_point(held, np.array([1, 5, 5, 5, 2, 5, 6, 6, 8]), [(1, 4), (5, 8)], ["a", "b"], [])
    assert (resume.start, resume.images) == (5, 1)


def test_a_ring_resumes_only_where_it_stopped_or_at_the_kept_prompt_end():
    kept = {"past_key.0": np.zeros(2)}
    held = _held([1, 2, 3, 4, 5, 6], prompt_len=4, at_prompt_end=kept)
    # Every held token matches: the ring is where it stopped.
    resume = resume_point(held, np.array([1, 2, 3, 4, 5, 6, 7]), [], [], RING)
    assert resume.start == 6 and resume.restore["past_key.0"][0] == 7.0
    # The reply differs after the prompt: back to the prompt's end, the ring's kept copy restored.
    resume = resume_point(held, np.array([1, 2, 3, 4, 5, 9, 9]), [], [], RING)
    assert resume.start == 4 and resume.restore["past_key.0"] is kept["past_key.0"]
    # The prompt itself differs: no ring state to restore, start over.
    assert resume_point(held, np.array([1, 2, 9, 9, 9]), [], [], RING) == Resume()
    # A device holds the ring (no host copy): only where it stopped.
    device = _held([1, 2, 3, 4, 5, 6], prompt_len=4)
    assert resume_point(device, np.array([1, 2, 3, 4, 5, 9, 9]), [], [], RING) == Resume()


def test_a_changed_image_set_keeps_the_leading_images_but_not_the_text():
    held = _held([1, 5, 2, 3], keys=("a",))
    kept = Resume(3, 1, {})
    assert image_set_resume(kept, held, ["a"]) is kept
    assert image_set_resume(kept, held, ["a", "b"]) == Resume(0, 1)
    assert image_set_resume(kept, held, ["c"]) == Resume(0, 0)
    assert image_set_resume(kept, None, ["a", "b"]) is kept
