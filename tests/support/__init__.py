"""Helpers shared by the tests: spawned engine peers, attackers, test vLLM engines, repo paths."""
