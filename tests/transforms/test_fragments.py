"""Fragments of a trajectory on crafted steps: a turn whose prompt does not extend its
previous turn starts a fragment, with its reason; choices and retries of one call are one
turn; stored steps (an earlier run's, or written before fragments) continue the count."""

from __future__ import annotations

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from claw_pipelines.transforms.fragments import (
    FRAGMENT_INPUT_COLUMNS,
    HISTORY_REWRITTEN,
    HISTORY_TRUNCATED,
    REPLY_RETOKENIZED,
    with_fragments,
)
from claw_pipelines.transforms.steps import with_content_ids

TOKENS = pl.List(pl.Int32)


def steps(rows: list[tuple[str, int, list[int], list[int]]]) -> pl.DataFrame:
    """(trajectory, step index, prompt, response) → steps with content ids and lengths."""
    uid, index, prompt, response = zip(*rows, strict=True)
    frame = pl.DataFrame(
        {
            "trajectory_uid": uid,
            "step_index": pl.Series(index, dtype=pl.Int64),
            "prompt_ids": pl.Series(prompt, dtype=TOKENS),
            "response_ids": pl.Series(response, dtype=TOKENS),
        }
    )
    return with_content_ids(frame).with_columns(
        step_key=pl.col("trajectory_uid") + ":" + pl.col("step_index").cast(pl.String),
        prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64),
        response_len=pl.col("response_ids").list.len().cast(pl.Int64),
    )


def stored(frame: pl.DataFrame, fragments: list[int | None], reasons: list[str | None]):
    """Steps as silver holds them (small columns, their fragments), no tokens."""
    return frame.select(FRAGMENT_INPUT_COLUMNS).with_columns(
        fragment=pl.Series(fragments, dtype=pl.Int64),
        fragment_reason=pl.Series(reasons, dtype=pl.String),
    )


def nothing_stored() -> pl.DataFrame:
    return stored(steps([("x", 0, [1], [1])]), [0], [None]).clear()


def judged(frame: pl.DataFrame, earlier: pl.DataFrame | None = None) -> list[tuple]:
    out = with_fragments(frame, nothing_stored() if earlier is None else earlier)
    return list(zip(out["step_key"], out["fragment"], out["fragment_reason"], strict=True))


SYSTEM, TASK = [1, 2, 3], [4, 5]


def test_every_reason_of_the_vocabulary():
    first = [*SYSTEM, *TASK]
    rows = [
        ("t", 0, first, [10, 11]),  # the first turn
        ("t", 1, [*first, 10, 11, 20], [12]),  # extends it
        ("t", 2, [*first, 10, 11, 20, 12, 21], [13]),  # extends it
        ("t", 3, [*SYSTEM, *TASK, 90, 91], [14]),  # turns 1..2 summarized: rewritten
        ("t", 4, [*SYSTEM, *TASK, 90, 91, 14, 22], [15]),  # extends the summary
        ("t", 5, [*SYSTEM, *TASK, 90, 91, 14, 22, 16, 23], [17]),  # reply 15 re-encoded
        ("t", 6, [*SYSTEM, *TASK, 90, 91, 14, 22, 16, 23, 17, 24], [18]),  # extends
        ("t", 7, [*first, 10, 11, 24], [19]),  # back to turn 0, another follow-up
        ("t", 8, first, [25]),  # turn 0's prompt again: truncated
        ("t", 9, [7, 7], [26]),  # nothing in common: rewritten
    ]
    assert judged(steps(rows)) == [
        ("t:0", 0, None),
        ("t:1", 0, None),
        ("t:2", 0, None),
        ("t:3", 1, HISTORY_REWRITTEN),
        ("t:4", 1, None),
        ("t:5", 2, REPLY_RETOKENIZED),
        ("t:6", 2, None),
        ("t:7", 3, HISTORY_TRUNCATED),
        ("t:8", 4, HISTORY_TRUNCATED),
        ("t:9", 5, HISTORY_REWRITTEN),
    ]


def test_choices_and_retries_of_one_call_are_one_turn():
    first = [*SYSTEM, *TASK]
    rows = [
        ("n", 0, first, [10]),  # a call with n = 2: two choices, one prompt
        ("n", 1, first, [11]),
        ("n", 2, [*first, 11, 20], [12]),  # continues the second choice
        ("n", 3, [*first, 11, 20], [13]),  # a retry of that call
        ("n", 4, [*first, 11, 20, 13, 21], [14]),  # continues the retry
        ("n", 5, [*first, 99], [15]),  # rewritten, in a call of two choices
        ("n", 6, [*first, 99], [16]),
    ]
    assert judged(steps(rows)) == [
        ("n:0", 0, None),
        ("n:1", 0, None),
        ("n:2", 0, None),
        ("n:3", 0, None),
        ("n:4", 0, None),
        ("n:5", 1, HISTORY_REWRITTEN),
        ("n:6", 1, HISTORY_REWRITTEN),
    ]


def test_stored_steps_continue_the_count_and_trajectories_stay_apart():
    first = [*SYSTEM, *TASK]
    before = steps(
        [
            ("a", 0, first, [10]),
            ("a", 1, [*first, 77], [11]),  # an earlier run's break
            ("b", 0, first, [10]),
            ("old", 0, first, [10]),  # written before fragments: no number
        ]
    )
    earlier = stored(before, [0, 1, 0, None], [None, HISTORY_REWRITTEN, None, None])
    new = steps(
        [
            ("a", 2, [*first, 77, 11, 30], [12]),  # extends the stored turn 1
            ("a", 3, [*first, 55], [13]),  # breaks again: fragment 2
            ("a", 4, [*first, 55], [14]),  # a retry of turn 3: same fragment, same reason
            ("b", 1, [*first, 10, 30], [12]),  # b is untouched by a's breaks
            ("old", 1, [8], [9]),  # counts on from 0
        ]
    )
    assert judged(new, earlier) == [
        ("a:2", 1, None),
        ("a:3", 2, HISTORY_REWRITTEN),
        ("a:4", 2, HISTORY_REWRITTEN),
        ("b:1", 0, None),
        ("old:1", 1, HISTORY_REWRITTEN),
    ]
    # a later choice of a stored call takes that call's fragment and reason
    sibling = steps([("a", 2, [*first, 77], [12])])
    assert judged(sibling, earlier) == [("a:2", 1, HISTORY_REWRITTEN)]


def test_a_run_split_anywhere_decides_what_one_run_decides():
    first = [*SYSTEM, *TASK]
    rows = [
        ("s", 0, first, [10]),
        ("s", 1, [*first, 10, 20], [11]),
        ("s", 2, [*first, 66], [12]),
        ("s", 3, [*first, 66, 12, 20], [13]),
        ("s", 4, [*first, 10, 20], [14]),
        ("s", 5, [*first, 10, 20, 14, 9], [15]),
    ]
    whole = with_fragments(steps(rows), nothing_stored())
    for cut in range(1, len(rows)):
        head = with_fragments(steps(rows[:cut]), nothing_stored())
        stored_head = head.select(*FRAGMENT_INPUT_COLUMNS, "fragment", "fragment_reason")
        tail = with_fragments(steps(rows[cut:]), stored_head)
        both = pl.concat([head, tail])
        assert both.select("fragment", "fragment_reason").equals(
            whole.select("fragment", "fragment_reason")
        ), cut


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=3)),
        min_size=1,
        max_size=8,
    )
)
def test_a_fragment_starts_exactly_where_a_turn_stops_extending_the_previous_one(turns):
    """Random conversations: each turn keeps some of the previous turn's sequence (all of it,
    or a cut) and adds tokens; the fragment grows exactly at the turns that do not extend
    their previous turn (and do not repeat its prompt)."""
    rows, sequence = [], [1]
    for index, (keep, added) in enumerate(turns):
        prompt = sequence if keep == 3 else sequence[: max(1, len(sequence) - keep - 1)]
        prompt = [*prompt, *added]
        rows.append(("r", index, prompt, [50 + index]))
        sequence = [*prompt, 50 + index]
    out = with_fragments(steps(rows), nothing_stored())
    expected, fragment = [], 0
    for index, (_, prompt, _response) in enumerate((r[1], r[2], r[3]) for r in rows):
        if index:
            before = rows[index - 1]
            whole = [*before[2], *before[3]]
            same_call = prompt == before[2]
            if not same_call and prompt[: len(whole)] != whole:
                fragment += 1
        expected.append(fragment)
    assert out["fragment"].to_list() == expected
    starts = out.filter(pl.col("fragment") != pl.col("fragment").shift(1).fill_null(0))
    assert starts["fragment_reason"].null_count() == 0
