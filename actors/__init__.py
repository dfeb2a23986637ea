"""Long-lived asyncio actors that own the gateway's state; callers hold handles only."""

from actors.runtime import (
    Actor,
    ActorError,
    ActorRef,
    ActorStopped,
    AskTimeout,
    MailboxFull,
    Supervisor,
)

__all__ = [
    "Actor",
    "ActorError",
    "ActorRef",
    "ActorStopped",
    "AskTimeout",
    "MailboxFull",
    "Supervisor",
]
