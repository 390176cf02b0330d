"""This package shows a person what a run and a sweep did: the console's progress lines and bars,
the report pages' HTML and charts, experiment tracking, the sweep's comparison report, and the
model card pushed to the Hub."""
