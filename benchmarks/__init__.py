"""Side-by-side benchmarks of paratrain against its peers (`python -m benchmarks.suite`)."""
