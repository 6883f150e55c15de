"""Entry points as a user meets them: one-line user errors (quiet library
logs: tests/test_online_main.py).

Each test runs a real entry point (`python -m experiments...`) in a subprocess.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import cli, paper
from osd_jax.checkpoints import layout, loading

from tests.entry_points import ROOT, one_device_env


def run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=one_device_env(),
                        capture_output=True, text=True, timeout=900)


def assert_user_error(done: subprocess.CompletedProcess, *words: str) -> None:
  """Exit status 1 and stderr of one line, `error: ...` naming the problem."""
  assert done.returncode == 1, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
  for word in words:
    assert word in lines[0]


# --- user errors through experiments.generate ------------------------------


def test_missing_model_path(tmp_path):
  path = str(tmp_path / "nowhere.gguf")
  assert_user_error(run("-m", "experiments.generate", f"--target={path}"),
                    "not found", path)


def test_hf_directory_without_weights(tmp_path):
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 32, "max_position_embeddings": 64}
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert_user_error(run("-m", "experiments.generate", f"--target={tmp_path}"),
                    "no .safetensors weights", str(tmp_path))


def test_bad_flag_value():
  assert_user_error(run("-m", "experiments.generate", "--k=four"), "--k", "four")


@pytest.mark.real_model
def test_truncated_gguf(tmp_path):
  path = tmp_path / "model.gguf"
  with open(loading.default_gguf_path(), "rb") as f:
    path.write_bytes(f.read(1 << 20))
  assert_user_error(run("-m", "experiments.generate", f"--target={path}"),
                    "Cannot read GGUF file", str(path))


@pytest.mark.real_model
def test_negative_k():
  """Refused while parsing flags, before a draft (and its warm start) loads."""
  assert_user_error(run("-m", "experiments.generate", "--k=-1", "--max_new_tokens=2"),
                    "--k=-1", "non-negative")


@pytest.mark.real_model
def test_prompt_longer_than_the_context():
  prompt = "hello " * 9000  # about 9,000 tokens; SmolLM2's context is 8,192
  assert_user_error(run("-m", "experiments.generate", f"--prompt={prompt}",
                        "--max_new_tokens=2"), "exceeds the context")


def test_lookup_alone_runs_as_the_readme_says_and_prints_strict_json(tmp_path):
  """README's `--draft=ngram` example: the serving default --hybrid gives way
  to lookup alone (an explicit --hybrid is still refused), and a request
  that drafts nothing prints alpha as null, not NaN."""
  from tests import tiny_models  # pylint: disable=import-outside-toplevel
  target, _ = tiny_models.pair()
  loading.save_hf(target, str(tmp_path / "target"))
  args = ["-m", "experiments.generate", f"--target={tmp_path / 'target'}", "--chat",
          "--k=2", "--draft=ngram", "--output=json", "--prompt=w5 w6 w7",
          "--max_new_tokens=1"]
  done = run(*args)
  assert done.returncode == 0, done.stderr[-3000:]
  refuse = lambda constant: pytest.fail(f"{constant} is not JSON")
  record = json.loads(done.stdout.strip().splitlines()[-1], parse_constant=refuse)
  assert record["alpha"] is None and len(record["token_ids"]) == 1
  assert_user_error(run(*args, "--hybrid"), "--hybrid needs a learned draft")


# --- what cli.run counts as a user error ------------------------------------


def run_main(body: str, *flags: str) -> subprocess.CompletedProcess:
  """A throwaway entry point whose main runs `body`."""
  source = ("from absl import app, logging\nimport numpy as np\n"
            "from experiments import cli\n"
            f"def main(argv):\n  {body}\ncli.run(main)\n")
  return run("-c", source, *flags)


def test_usage_error_is_one_line():
  assert_user_error(run_main("raise app.UsageError('--x must be positive')"),
                    "--x must be positive", "--helpshort")


def test_a_bug_keeps_its_traceback():
  done = run_main("np.zeros(4).reshape(3)")  # numpy's ValueError: our bug
  assert done.returncode == 1
  assert "Traceback" in done.stderr and "reshape" in done.stderr


def test_user_error_rule():
  assert cli.is_user_error(layout.CheckpointError("no weights"))
  with pytest.raises(ValueError) as ours:
    paper.Settings(fractions=(0.0,))  # a `raise` in experiments/: an input check
  assert cli.is_user_error(ours.value)
  with pytest.raises(ValueError) as numpys:
    np.zeros(4).reshape(3)
  assert not cli.is_user_error(numpys.value)
  with pytest.raises(ValueError) as unpacking:
    _, _ = [1, 2, 3]
  assert not cli.is_user_error(unpacking.value)
  assert not cli.is_user_error(KeyError("x"))


# --- quiet by default ---------------------------------------------------------


def test_library_info_logs_only_with_verbosity():
  body = "logging.info('library detail'); logging.warning('a warning')"
  quiet, verbose = run_main(body), run_main(body, "-v", "0")
  assert quiet.returncode == verbose.returncode == 0
  assert "a warning" in quiet.stderr and "library detail" not in quiet.stderr
  assert "library detail" in verbose.stderr


# --- shared flags an entry point does not read, and bad flag values ---------


@pytest.mark.parametrize("args, words", [
    (["experiments.bench_decode", "--draft=ngram"], ["--draft has no effect here"]),
    (["experiments.offline_distill", "--warm_start=chat"],
     ["--warm_start has no effect here"]),
    (["experiments.bench_speculative", "--ngram_cap_at_match=false"],
     ["--ngram_cap_at_match has no effect here", "full width"]),
    (["experiments.bench_lookup", "--ngram_history=0"], ["--ngram_history", "at least 1"]),
    (["experiments.bench_speculative", "--ks=0"], ["--ks", "positive integers"]),
    (["experiments.serve", "--top_p=0"], ["--top_p", "above 0"]),
    (["experiments.serve", "--update_steps_per_call=1", "--minibatch=0"],
     ["--update_steps_per_call", "--minibatch"]),
    (["experiments.online", "--devices=0"], ["--devices", "'0'"]),
])
def test_flags_an_entry_point_cannot_honour_end_in_one_line(args, words):
  assert_user_error(run("-m", *args), *words)
