"""pdunit: single-machine prefill/decode disaggregation for streaming TTS.

The subpackages map to the repository's top-level folders (see pyproject.toml):
pdunit.engine (engine/), pdunit.kernels (kernels/), pdunit.sidecars (sidecars/),
pdunit.operator (operator/), pdunit.bench (bench/). pdunit.cli (pkg/cli.py) is the
`pdunit` command.
"""

__version__ = "0.1.0"
