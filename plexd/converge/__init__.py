"""The converge engine: every piece of machine state is a domain observed, diffed and repaired by one engine.

    change.py   `Change`: one typed change, also its drift-report line (`Correction`)
    domain.py   `Domain`: observe / plan / apply, an event-delta entry point, teardown, status; `DomainResult`
    engine.py   `Engine`: runs the domains in order, one converge at a time; `ConvergeResult`
    hold.py     `plexd reconcile hold`: while it lasts the engine only plans
    coalesce.py converge requests from events: a burst costs a few applies, not one each

The domains live with what they own (`plexd.mesh.wireguard_domain`, `plexd.firewall.firewall_domain`,
`plexd.nodeapi.cache`) and are listed in one place, `plexd.node.domain_list.build_engine`.
"""
