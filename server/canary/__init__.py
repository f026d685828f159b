"""Do the workers still compute the same numbers? `monitor` scores a few fixed sequences on every
ready worker, between user requests, and acts on the verdict; `compare` is what it compares
and how answers become a verdict (pure)."""
