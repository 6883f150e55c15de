"""The run summaries: acceptance by draft position from per-request records."""

import json
import math

from osd_jax.serving.report import (acceptance_by_position, learning_cost, learning_lines,
                                   read_jsonl, speed_summary)


def record(served, reached, accepted, domain="math"):
  return {"request": served, "served": served, "domain": domain, "alpha": 0.5, "new_tokens": 8,
          "tokens_per_target_call": 2.0, "finished_s": float(served),
          "reached_by_position": reached, "accepted_by_position": accepted}


def test_acceptance_by_position_pools_requests_per_position():
  records = [record(1, [4, 2, 0], [2, 1, 0]), record(2, [4, 0, 0], [0, 0, 0])]
  got = acceptance_by_position(records)
  assert got[:2] == [2 / 8, 1 / 2]
  assert math.isnan(got[2])  # never reached: no figure, not 0
  assert acceptance_by_position([]) == []
  assert acceptance_by_position([record(1, [], [])]) == []  # target-only


def test_speed_summary_reports_the_last_window_by_position():
  records = [record(i, [2, 1], [1, 0]) for i in range(1, 4)] + [record(4, [2, 2], [2, 1])]
  last = speed_summary(records, tail=1)["last"]
  assert last["acceptance_by_position"] == [1.0, 0.5]


def test_a_request_served_again_after_a_resume_counts_once(tmp_path):
  """A resumed run appends the records of requests it serves again."""
  path = tmp_path / "online.jsonl"
  first = [record(1, [], []), record(2, [], []), dict(record(3, [], []), alpha=0.1)]
  replayed = [dict(record(3, [], []), alpha=0.2), record(4, [], []),
              {"request": 5, "error": "does not fit"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in first + replayed))
  records = read_jsonl(str(path))
  assert [r["request"] for r in records] == [1, 2, 3, 4]
  assert records[2]["alpha"] == 0.2


def test_each_segment_says_what_the_learned_draft_proposed_and_got_accepted():
  records = [dict(record(i, [2], [1], domain), proposed=10, draft_proposed=d,
                  draft_accepted=a)
             for i, domain, d, a in ((1, "math", 4, 1), (2, "math", 0, 0),
                                     (3, "sql", 6, 5))]
  math_seg, sql_seg = speed_summary(records, tail=4)["segments"]
  assert (math_seg["draft_proposed"], math_seg["draft_accepted"]) == (4, 1)
  assert math_seg["draft_share"] == 4 / 20
  assert (sql_seg["draft_proposed"], sql_seg["draft_accepted"]) == (6, 5)
  plain = speed_summary([record(1, [2], [1])], tail=4)["segments"][0]
  assert "draft_proposed" not in plain  # no gated hybrid: nothing to say
  summary = {"run": "online", "segments": [math_seg, sql_seg],
             **learning_cost([dict(r, updates=1, update_s=0.5) for r in records])}
  text = learning_lines([summary])
  assert "math 4 proposed, 1 accepted (20% of all proposed tokens)" in text
  assert "3 updates, 1.5 s, 50.0% of serving time" in text  # last finish at 3 s
