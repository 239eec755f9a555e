"""Finished ads: templates (``template``), rows checked against them (``rows``)."""
