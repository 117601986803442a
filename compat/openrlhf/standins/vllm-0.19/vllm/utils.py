import uuid


def random_uuid() -> str:  # vLLM's: a request's id
    return uuid.uuid4().hex
