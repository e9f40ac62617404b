"""Public op functions: argument checks, backend choice, autograd and fake implementations."""
