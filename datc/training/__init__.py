"""The session and the loop around the step: building the session and its model set, the
training loop, the run's life cycle (open, resume, save, finish, the final policy) and
evaluation."""
