"""Data as users have it: reading and checking dataset files, and the formats they come in."""
