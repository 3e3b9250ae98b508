"""Our lm-eval backend (RlverLM: our model + KV-cached sampler) against lm-eval's own Hugging Face
backend (HFLM, transformers in fp32) on the embedded SmolLM2-135M and the shipped offline tasks:
the same per-sample log-likelihoods (fp32 rounding), the same chosen answers, the same greedy texts.
HFLM runs in .venv-torch (`torch_reference`); lm-eval's evaluator drives both backends from here.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("lm_eval", reason="needs lm-eval==0.4.13 (pip install -e '.[eval]')")
import torch_reference  # noqa: E402

if not torch_reference.available():
  pytest.skip(torch_reference.SKIP_REASON, allow_module_level=True)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402

from rlver_jax.evaluation import general as general_eval  # noqa: E402
from rlver_jax.evaluation.lm_eval_backend import RlverLM  # noqa: E402
from rlver_jax.models import load_pretrained  # noqa: E402
from rlver_jax.models.embedded import embedded_model_dir  # noqa: E402
from rlver_jax.models.tokenizer import load_tokenizer  # noqa: E402

RTOL, ATOL = 2e-5, 2e-4  # fp32 sums of up to ~100 log-probs, two different matmul kernels
LIMIT = 4


class _TorchHFLM(LM):
  """lm-eval's HFLM held by the torch worker: each request's args go there (all HFLM reads of an
  Instance), its answers come back; the chat template is HFLM's own."""

  def __init__(self, **kwargs):
    super().__init__()
    self._worker = torch_reference.worker()
    self._hflm = torch_reference.TorchSide(self._worker.request("hflm", kwargs))
    self._handle = self._hflm.handle
    self.tokenizer = load_tokenizer(kwargs["pretrained"])  # general_eval.evaluate reads its template

  def _run(self, method, requests):
    if not requests:
      return []
    return self._worker.request("lm_requests", self._handle, method, requests[0].request_type,
                                [r.args for r in requests])

  def loglikelihood(self, requests, disable_tqdm=False):
    return self._run("loglikelihood", requests)

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    return self._run("loglikelihood_rolling", requests)

  def generate_until(self, requests, disable_tqdm=False):
    return self._run("generate_until", requests)

  def apply_chat_template(self, chat_history, add_generation_prompt=True):
    return self._worker.request("call", self._handle, "apply_chat_template", (chat_history,),
                                {"add_generation_prompt": add_generation_prompt})

  @property
  def tokenizer_name(self):
    return self._worker.request("get", self._handle, "tokenizer_name")

  def chat_template(self, chat_template=False):
    return self._worker.request("call", self._handle, "chat_template", (chat_template,), {})


@pytest.fixture(scope="module")
def backends():
  path = embedded_model_dir()
  model, _ = load_pretrained(path, dtype=jnp.float32)
  # batch 3 with 4+ requests per call: batches with padding rows, and more than one batch.
  ours = RlverLM(model, load_tokenizer(path), batch_size=3, max_length=96, max_gen_toks=24,
                 decode_chunk=5, checkpoint_dir=path)
  hf = _TorchHFLM(pretrained=path, device="cpu", dtype="float32", batch_size=3, max_length=96)
  # One torch thread, as this test has always run transformers (beside JAX's threads on 2 cores).
  threads = torch_reference.worker().request("torch_threads", 1)
  yield ours, hf
  torch_reference.worker().request("torch_threads", threads)


def _by_doc(results, task):
  return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_local_tasks_match_the_hf_backend(backends):
  ours, hf = backends
  res = {}
  for name, lm in (("ours", ours), ("hf", hf)):
    res[name] = general_eval.evaluate(lm, ["rlver_tiny_mc", "rlver_tiny_gen"], limit=LIMIT,
                                      apply_chat_template=True, log_samples=True, bootstrap_iters=0)
  ours_mc, hf_mc = _by_doc(res["ours"], "rlver_tiny_mc"), _by_doc(res["hf"], "rlver_tiny_mc")
  assert len(ours_mc) == LIMIT
  for a, b in zip(ours_mc, hf_mc):
    assert a["arguments"] == b["arguments"]  # same chat-templated prompts and choices
    la, lb = (np.array([r[0][0] for r in s["resps"]]) for s in (a, b))
    np.testing.assert_allclose(la, lb, rtol=RTOL, atol=ATOL)
    assert la.argmax() == lb.argmax()
    assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]  # is_greedy flags
  ours_gen, hf_gen = _by_doc(res["ours"], "rlver_tiny_gen"), _by_doc(res["hf"], "rlver_tiny_gen")
  texts = [s["resps"][0][0] for s in ours_gen]
  assert texts == [s["resps"][0][0] for s in hf_gen]
  assert any(t.strip() for t in texts), texts  # the templated model answers something
  assert all("\n" not in t for t in texts)  # cut at the task's stop string
  for key in ("rlver_tiny_mc", "rlver_tiny_gen"):
    assert res["ours"]["results"][key] == res["hf"]["results"][key]


def test_requests_directly_match_the_hf_backend(backends):
  ours, hf = backends
  ll = [Instance("loglikelihood", {}, args, i) for i, args in enumerate([
      ("Question: Which animal says moo?\nAnswer:", " a cow"),
      ("The sky is ", "blue"),                      # the trailing space moves to the continuation
      ("", "Hello world, how are you?"),           # empty context: scored after the prefix token
      ("One two three four", " five six seven eight nine ten")])]
  a, b = ours.loglikelihood(ll), hf.loglikelihood(ll)
  np.testing.assert_allclose([x[0] for x in a], [x[0] for x in b], rtol=RTOL, atol=ATOL)
  assert [x[1] for x in a] == [x[1] for x in b]
  # max_length 96: the long document is scored in several rolling windows.
  doc = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 16
  rolling = [Instance("loglikelihood_rolling", {}, (s,), i) for i, s in enumerate([doc, "Short."])]
  assert len(ours.tok_encode(doc)) > 2 * ours.max_length
  np.testing.assert_allclose(ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling),
                             rtol=RTOL, atol=ATOL)
  greedy = {"until": ["."], "do_sample": False, "max_gen_toks": 24}
  gen = [Instance("generate_until", {}, (p, dict(greedy)), i) for i, p in enumerate(
      ["Once upon a time", "The recipe for bread is simple:", "My favourite colour is",
       "Here is a list of fruits: apple,"])]
  texts = ours.generate_until(gen)
  assert texts == hf.generate_until(gen)
  assert all("." not in t for t in texts)


def test_sampling_follows_the_task_settings(backends):
  ours, _ = backends
  prompt = "Once upon a time"
  hot = {"until": [], "do_sample": True, "temperature": 1.5, "max_gen_toks": 12}
  sampled = ours.generate_until([Instance("generate_until", {}, (prompt, dict(hot)), i)
                                 for i in range(3)])
  assert len(set(sampled)) > 1  # three draws at T=1.5 over 12 tokens do not coincide
  greedy = {"until": [], "do_sample": True, "temperature": 0.0, "max_gen_toks": 12}
  once = ours.generate_until([Instance("generate_until", {}, (prompt, dict(greedy)), i)
                              for i in range(3)])
  assert len(set(once)) == 1


def test_unsupported_generation_settings_are_refused(backends):
  ours, _ = backends
  req = Instance("generate_until", {}, ("Hi", {"until": [], "num_beams": 4}), 0)
  with pytest.raises(ValueError, match="generation setting.s. num_beams not supported"):
    ours.generate_until([req])
