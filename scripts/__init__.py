"""Scripts a user runs by hand, the benchmarks (bench/) and the study generators (studies/): see README.md."""
