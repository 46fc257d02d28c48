"""Study generators and one-off probes whose results are committed under results/: see scripts/README.md."""
