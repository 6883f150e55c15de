"""The programs a server compiles fit the host's vm.max_map_count, or it refuses."""

import dataclasses

import pytest

from osd_jax.decoding.engine import Engine
from osd_jax.serving import live, online, program_maps
from tests.test_compile_while_serving import serve_together
from tests.test_online import MAIN, MAX_NEW, QUERIES, prompt_ids, tiny_pair

WINDOWS, BATCHES = (64, 128, 256, 512, 1024), (1, 2, 4, 8)


def _plan(limit: int, held: int = 1000, serve_maps=lambda batch: 5000):
  return program_maps.plan(WINDOWS, BATCHES, serve_maps=serve_maps, inserts=9,
                           maps=(held, limit), flag_hint="lower --cache_size")


def test_the_limit_and_the_maps_held_are_read_from_the_files(tmp_path):
  (tmp_path / "limit").write_text("1234\n")
  (tmp_path / "maps").write_text("a\nb\nc\n")
  assert program_maps.memory_maps(str(tmp_path / "limit"),
                                  str(tmp_path / "maps")) == (3, 1234)
  assert program_maps.memory_maps(str(tmp_path / "none")) is None  # not Linux


def test_all_programs_where_they_fit_else_the_most_useful():
  assert len(_plan(1_000_000).programs) == 20
  plan = _plan(65_530)  # 11 x 5,000 + inserts fit in 90% of it, 12 do not
  assert plan.programs == tuple(sorted(
      [(1024, b) for b in BATCHES] + [(w, 1) for w in WINDOWS[:-1]]
      + [(512, 2), (512, 4), (512, 8)]))
  assert plan.maps == 11 * 5000 + 9 * program_maps.MAPS_PER_INSERT
  assert plan.maps + 1000 <= 0.9 * 65_530
  # A call runs on the fewest slots it needs, then the narrowest window.
  assert plan.program(60, 1) == (64, 1)
  assert plan.program(300, 2) == (512, 2) and plan.program(600, 2) == (1024, 2)
  assert plan.program(60, 3) == (512, 4) and plan.program(600, 8) == (1024, 8)
  assert _plan(10_000).programs == ((1024, 8),)  # the widest window, every slot


def test_plain_programs_come_before_the_narrower_windows_serve_programs():
  plain = lambda limit: program_maps.plan(
      WINDOWS, BATCHES, serve_maps=lambda batch: 5000, inserts=9,
      maps=(1000, limit), flag_hint="", plain_maps=lambda batch: 2000,
      learn_maps=3000)
  every = plain(1_000_000)
  assert len(every.programs) == len(every.plain) == 20
  # The widest window's 4 serve and 4 plain programs; then 512's 4 plain
  # programs and its one-slot serve program; then 256's plain ones, with no
  # room left for its serve program; the last room takes 128's 8-slot plain one.
  plan = plain(65_530)
  assert plan.programs == tuple(sorted([(1024, b) for b in BATCHES] + [(512, 1)]))
  assert plan.plain == tuple(sorted([(w, b) for w in (256, 512, 1024) for b in BATCHES]
                                    + [(128, 8)]))
  assert plan.maps == 5 * 5000 + 13 * 2000 + 9 * program_maps.MAPS_PER_INSERT + 3000
  # A plain call runs on the plain program with the fewest slots holding it,
  # then the narrowest window.
  assert plan.plain_program(60, 3) == (256, 4)
  assert plan.plain_program(300, 1) == (512, 1)
  assert _plan(65_530).plain == () and _plan(65_530).plain_program(60, 8) is None


def test_a_plan_cut_to_what_is_compiled_grows_a_program_at_a_time():
  plan = _plan(1_000_000)
  first = plan.only([((1024, b), False) for b in BATCHES])
  assert first.programs == tuple((1024, b) for b in BATCHES) and first.plain == ()
  assert first.program(60, 1) == (1024, 1)
  grown = first.with_program((64, 1), False).with_program((128, 2), True)
  assert grown.program(60, 1) == (64, 1) and grown.plain == ((128, 2),)
  assert grown.plain_program(100, 2) == (128, 2) and grown.plain_program(200, 2) is None


def test_programs_that_cannot_fit_are_refused_in_one_line():
  with pytest.raises(program_maps.ProgramsDoNotFit) as refused:
    _plan(5_000)
  message = str(refused.value)
  assert "\n" not in message and "--cache_size" in message
  assert "vm.max_map_count = 5,000" in message and program_maps.RAISE_IT in message


def test_the_real_models_defaults_fit_a_standard_host():
  """SmolLM2 (30 layers) with the 2-layer draft, learning at cache 1024 (5
  update lengths), beside what the loaded process held (about 900): every
  batch at the widest window and one slot at every window, and every plain
  program."""
  maps = lambda batch: program_maps.serve_program_maps(batch, 32)
  plain = lambda batch: program_maps.plain_program_maps(30)
  # The figures measured on an AMD EPYC with AVX-512 (program_maps.py).
  assert maps(8) >= 4_053 and maps(1) >= 2_326 and plain(1) >= 924
  assert program_maps.learn_program_maps(5) >= 1_665
  plan = program_maps.plan(WINDOWS, BATCHES, serve_maps=maps, inserts=9,
                           maps=(900, 65_530), flag_hint="", plain_maps=plain,
                           learn_maps=program_maps.learn_program_maps(5))
  assert {(1024, b) for b in BATCHES} | {(w, 1) for w in WINDOWS} <= set(plan.programs)
  assert len(plan.plain) == 20


def _engine(limit: int, **live_fields):
  target, draft = tiny_pair()
  cfg = dataclasses.replace(MAIN, sampling=None, learn=False)
  return target, live.LiveEngine(
      target, draft, cfg, live.LiveConfig(**live_fields), mesh=online.make_mesh(1),
      memory_maps=lambda: (1000, limit))


def test_the_engine_refuses_before_it_compiles(monkeypatch):
  def compiled(*args, **kwargs):
    raise AssertionError("a program was compiled")

  monkeypatch.setattr(online.Step, "serve", compiled)
  monkeypatch.setattr(live.LiveEngine, "_insert_nothing", compiled)
  with pytest.raises(program_maps.ProgramsDoNotFit, match="--cache_size"):
    _engine(limit=2_000)


def test_merged_buckets_serve_the_same_greedy_text():
  """Only the widest window over every slot compiled: requests of every
  length, at every occupancy, get the target's greedy tokens."""
  target, engine = _engine(limit=5_500, num_slots=4)
  assert engine.plan.programs == ((MAIN.cache_size, 4),)
  prompts = [list(prompt_ids(q)) for q in QUERIES[:5]]
  engine.start()
  try:
    tokens = serve_together(engine, prompts)
  finally:
    engine.stop()
  window, slots = MAIN.cache_size, 4
  assert set(engine._step._serve) == {(MAIN.steps_per_call, window, slots, False)}  # pylint: disable=protected-access
  reference = Engine(target, k=0, max_new_tokens=MAX_NEW, num_slots=4)
  assert tokens == [r.token_ids for r in reference.generate_ids(prompts)]
