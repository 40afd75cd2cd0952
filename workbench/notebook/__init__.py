"""Notebooks: the :class:`~workbench.notebook.experiment.Experiment` API and the live widget."""
