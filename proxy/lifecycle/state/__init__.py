"""What the pool knows, and the pure rules that change it: the lowest sub-wing of lifecycle/.

`replicas` (a leaf: states and every allowed transition), `runtime` (one public model at run time:
state, replicas, admission, routing; and the runner half of the `Kind` seam), `kind` (the rules
half), `affinity` (pure rendezvous hashing with a load bound), `indices` (a new replica takes the
lowest free index), `outdated` (which settings a running replica's differ in, by name) and `wake`
(a loop's wake-up call, built before the loop and those that call it).
It may import `proxy.upstream`, launchers' specs and the root vocabulary; nothing else of
lifecycle/, not even for a type: the protocols the wings above implement are declared here.
"""
