"""Infrastructure every process shares: settings, logging, errors, the broker, paths."""
