"""bench_serve's table: a missing figure is '-', never 'nan'."""

from experiments import bench_serve_table


def row(run, level, tokens_per_s, rolling_alpha):
  return dict(run=run, level=level, requests=4, tokens_per_s=tokens_per_s,
              ttft_p50_ms=1.0, ttft_p99_ms=2.0, itl_p50_ms=1.0, itl_p99_ms=2.0,
              alpha=0.0, rolling_alpha=rolling_alpha, updates=0, update_s=0.0,
              learning_share=0.0, saved_s=0.0, plain_share=0.0)


def test_a_missing_figure_is_a_dash():
  table = bench_serve_table.table([
      row("target", "1 clients", 10.0, float("nan")),  # no drafts: no alpha
      row("online", "1 clients", 12.0, 0.5),
      row("online", "8 clients", 30.0, 0.4)])  # no target-only level: no ratio
  target, online, unmatched = table.splitlines()[2:]
  assert "nan" not in table
  assert "| 1.00x |" in target and "| - |" in target
  assert "| 1.20x |" in online and "| 0.500 |" in online
  assert "| 30.0 | - |" in unmatched


def test_each_run_is_compared_with_the_target_in_its_own_turns():
  table = bench_serve_table.table([
      dict(row("target", "1 clients", 10.0, float("nan")), beside="static"),
      dict(row("static", "1 clients", 9.0, 0.5), beside="static"),
      dict(row("target", "1 clients", 20.0, float("nan")), beside="online"),
      dict(row("online", "1 clients", 30.0, 0.5), beside="online")])
  target_static, static, target_online, online = table.splitlines()[2:]
  assert target_static.startswith("| target (beside static) |")
  assert "| 0.90x |" in static and "| 1.50x |" in online
