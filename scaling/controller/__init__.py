"""The RunPod controller: drives a RunPod endpoint's minimum workers from its queue with
scaling.policy (`python -m scaling.controller`).

Rooms: `meter` (arrival rate, idle gaps and queue wait from /health polls), `loop` (poll, decide,
apply), `recommend` (native settings for endpoints without a controller), `cli`.
"""

from scaling.controller.loop import Controller
from scaling.controller.meter import ArrivalMeter
from scaling.controller.recommend import recommend

__all__ = ["ArrivalMeter", "Controller", "recommend"]
