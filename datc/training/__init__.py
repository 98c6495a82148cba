"""The session and the loop around the step: building the session, the training loop, the run's
life cycle (open, resume, save, finish) and evaluation."""
