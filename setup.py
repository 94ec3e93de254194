"""fairseq-streambeam: streaming batched beam search for fairseq (see README.md)."""

from setuptools import find_packages, setup

# Pins: the official fairseq==0.12.2 does not import on Python 3.11 and its omegaconf pin is
# refused by current pip; ve-fairseq 0.12.3 is upstream fairseq main as a cp311 wheel and works
# with torch 2.13 (CPU wheel here). The other pins are what that combination resolves to.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "ve-fairseq==0.12.3",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "numpy==2.4.6",
    "sacrebleu==2.6.0",
    "sentencepiece==0.2.3",
    "tqdm",
]
# plots, and CTranslate2 as a reference decoder in the benchmark
BENCH = ["matplotlib>=3.8", "ctranslate2>=4.5"]
# the translation server (serve.py) and its load generator (bench/load.py)
SERVE = ["aiohttp>=3.9"]
# WMT'19 models: Moses tokenization, and requests for fairseq's hub download (file_utils.get_from_cache)
WMT19 = ["sacremoses>=0.1", "requests>=2.31"]

setup(
    name="fairseq-streambeam",
    version="0.1.0",
    description="Streaming variable-width batched beam search (and more) for fairseq models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["fairseq_streambeam", "fairseq_streambeam.*"]),
    package_data={"fairseq_streambeam": ["runtime/*.cc"]},  # the fused attention kernel, compiled on first use
    install_requires=INSTALL_REQUIRES,
    # fairseq's commands with the plugin's --user-dir and task filled in: they work from any directory
    entry_points={
        "console_scripts": [
            "streambeam-generate = fairseq_streambeam.cli:generate",
            "streambeam-interactive = fairseq_streambeam.cli:interactive",
            "streambeam-decode-corpus = fairseq_streambeam.cli:decode_corpus",
            "streambeam-calibrate = fairseq_streambeam.cli:calibrate",
            "streambeam-serve = fairseq_streambeam.cli:serve",
        ],
    },
    extras_require={
        "bench": [*BENCH, *SERVE],
        "serve": SERVE,
        "test": ["pytest>=8", "hypothesis>=6.100", "ruff>=0.6", *BENCH, *SERVE, *WMT19],
        # fastBPE, which the WMT'19 models also need, must be built by hand (see README):
        #   pip install cython setuptools wheel && pip install --no-build-isolation fastBPE==0.1.0
        "wmt19": WMT19,
    },
)
