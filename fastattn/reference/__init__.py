"""Plain-PyTorch definitions of every fastattn op: the definition of correct, and the
"reference" backend. Written for clarity, not speed; each runs on any device and dtype."""
