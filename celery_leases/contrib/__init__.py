"""Integrations with frameworks, each imported only by projects that use that framework."""
