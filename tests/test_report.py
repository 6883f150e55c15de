"""The run summaries: acceptance by draft position from per-request records."""

import json
import math

from osd_jax.serving.report import acceptance_by_position, read_jsonl, speed_summary


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
