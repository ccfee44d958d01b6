"""Pictures of what happened: the round timeline (the seeds' GPU timeline) and histograms."""

from specdec.viz.timeline import plot_timeline

__all__ = ["plot_timeline"]
