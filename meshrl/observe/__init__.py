"""Seeing a run: metrics and the console view, telemetry recorded inside actors,
the mesh status, the report, the profiler, and Monarch's own dashboard behind
meshrl's front."""
