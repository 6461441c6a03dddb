"""Wire protocols the collector speaks: each module decodes one protocol's requests into an
``Intake`` and encodes its responses."""
