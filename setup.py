"""Install tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from setuptools import find_packages, setup

setup(
    name="tfpipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for TensorFlow 2 and Keras 3",
    # Only `tfpipe` goes into site-packages: the reference models stay in models/ in the repository and install as
    # tfpipe.models, so no top-level `models` package clashes with another project's. The user's tools (scripts/)
    # and the benchmarks (benchmarks/) are not installed: they run from the repository, which each puts on its path.
    packages=find_packages(include=["tfpipe", "tfpipe.*"]) + ["tfpipe.models"],
    package_dir={"tfpipe.models": "models"},
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "numpy>=1.26",
        "absl-py>=2.1",
        "tensorboard>=2.21,<2.22",  # TensorFlow no longer brings it; keras.callbacks.TensorBoard needs it
        "grpcio>=1.24,<2",  # tfpipe.distributed.health calls the workers; TensorFlow depends on it (same range)
    ],
    extras_require={
        # the TFDS path is tested with mock data; ruff lints and checks formatting in .ci/run (its minor pinned:
        # the formatter's output changes between minors); mypy checks tfpipe's type hints there (config in setup.cfg;
        # its minor pinned too: a new minor brings new checks)
        # importlib_resources: tensorflow-datasets' download path imports it (through etils.epath) without
        # depending on it
        # keras-hub: the keras_hub tasks' tests (tests/integration/test_hub.py, tests/scripts/test_hub_scripts.py);
        # it brings tensorflow-text, pinned to TensorFlow
        # pytest-xdist: three test processes (setup.cfg) take the suite to 17 minutes on a 2-core machine (two: 19),
        # where most tests wait on TensorFlow subprocesses and workers
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5,<4",
            "tensorflow-datasets>=4.9,<5",
            "importlib_resources>=6",
            "ruff>=0.17,<0.18",
            "mypy>=2.4,<2.5",
            "keras-hub>=0.32,<0.33",
        ],
        "data": ["tensorflow-datasets>=4.9,<5", "importlib_resources>=6"],
        # keras_hub tasks (GPT-2, Gemma, Llama, BERT, ...) pipelined as they are: models/hub.py, --model=hub:NAME;
        # tfpipe itself never imports it
        "hub": ["keras-hub>=0.32,<0.33"],
        "timeline": ["matplotlib>=3.7"],  # scripts/timeline.py draws its PNG with it
        # benchmarks/benchmark_peers.py times torch.distributed.pipelining beside tfpipe, in processes of its own;
        # tfpipe itself never imports torch
        "peers": ["torch>=2.9,<2.15"],
    },
)
