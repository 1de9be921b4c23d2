"""The load driver: a synthetic TTS workload sent to an LB, and what its streams measured.

`pdunit local` runs a short load with it; `pdunit bench` builds its benchmarks on it.
Never starts a unit and never writes result files: those are bench/'s.
"""
