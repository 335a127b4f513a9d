"""The benchmark's Django app: jobs declared from the environment, and a probe."""
