"""Progress bars (osd_jax.progress) and quiet data-set preparation."""

import io
import logging

from osd_jax import progress
from osd_jax.data.builder import read_split
from osd_jax.data.math import GsmSymbolicMath


def test_bar_counts_with_an_eta_and_hides_empty_work(monkeypatch):
  terminal = io.StringIO()
  terminal.isatty = lambda: True
  monkeypatch.setattr("sys.stderr", terminal)
  with progress.bar(3, "preparing", "examples", delay=0) as bar:
    bar.update(3)
  assert "3/3" in terminal.getvalue() and "examples/s" in terminal.getvalue()
  assert progress.bar(0, "nothing").disable


def test_preparing_a_data_set_prints_no_tfds_banners_or_bars(tmp_path, capfd, caplog):
  builder = GsmSymbolicMath(num_train=6, num_eval=2, data_dir=tmp_path)
  with caplog.at_level(logging.WARNING):
    assert len(read_split(builder, "train")) == 6
  out, err = capfd.readouterr()
  assert out == "" and err == ""  # no "Downloading and preparing", no tqdm
  assert not caplog.records  # nor "Using custom data configuration"
