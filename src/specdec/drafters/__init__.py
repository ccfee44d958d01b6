"""Prophets: every drafter implements `specdec.drafters.base.Drafter`."""
