"""What the pool knows, and the pure rules that change it: the lowest sub-wing of lifecycle/.

`replicas` (a leaf: states and every allowed transition), `runtime` (one public model at run time:
state, replicas, admission, routing) and `affinity` (pure rendezvous hashing with a load bound).
It may import `proxy.upstream`, launchers' specs and the root vocabulary; nothing else of
lifecycle/, not even for a type: the protocols the wings above implement are declared here.
"""
