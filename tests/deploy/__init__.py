"""Deploying and running: settings, drain, scale-out on two processes, the code's shape, forks, the benches' smoke runs."""
