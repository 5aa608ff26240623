"""Decentralized (gossip) aggregators: each worker keeps its own model and mixes it with its
neighbours' over a communication graph (`dsgd_cli.topology`), with no global average.

=========  ==========================================  ============================
plugin     algorithm                                   communication
=========  ==========================================  ============================
dpsgd      D-PSGD (Lian et al. 2017)                   synchronous, overlapped with backward
sgp        Stochastic Gradient Push (Assran et al.)    synchronous push-sum rounds
osgp       Overlap SGP                                 push-sum on background threads, bounded delay
adpsgd     AD-PSGD (Lian et al. 2018)                  asynchronous pairwise averaging
choco      CHOCO-SGD (Koloskova et al. 2019)           compressed x − x̂ per neighbour, synchronous
dcd        DCD-PSGD (Tang et al. 2018)                 compressed model change per neighbour
=========  ==========================================  ============================

Modules: `graph` (topology options and checks), `vector` (the model as a flat vector),
`pushsum` (push-sum state and messages), `overlap` (OSGP's background rounds), `compressed`
(what choco and dcd share: fixed symmetric mixing, compressor checks, payload rounds), and one
module per plugin.
"""

from plugins.aggregators.gossip.adpsgd import ADPSGD
from plugins.aggregators.gossip.choco import Choco
from plugins.aggregators.gossip.dcd import DCD
from plugins.aggregators.gossip.dpsgd import DPSGD
from plugins.aggregators.gossip.osgp import OSGP
from plugins.aggregators.gossip.sgp import SGP

__all__ = ["ADPSGD", "DCD", "DPSGD", "Choco", "OSGP", "SGP"]
