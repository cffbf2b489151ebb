"""The fair queue on its own: weights, work conservation, caps, timeouts, cancellation.

Slots are freed by the test one at a time, so every assertion is on admission order."""

from __future__ import annotations

import asyncio

import pytest

from epdserve.router.fairqueue import FairQueue, QueueFull, QueueTimeout


class Slots:
    """A capacity the test turns up and down."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> int:
        return self.n


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def backlog(queue: FairQueue, tenants: dict[str, tuple[float, int]]):
    """Queue ``count`` requests of each tenant (weight, count); returns (tenant, task)s."""
    tasks = []
    for name, (weight, count) in tenants.items():
        for _ in range(count):
            tasks.append((name, asyncio.ensure_future(queue.acquire(name, weight))))
            await asyncio.sleep(0)
    await settle()
    return tasks


async def drain(queue: FairQueue, tasks, n: int, holder: str) -> list[str]:
    """Free one slot at a time (``holder``'s, then each admitted tenant's) and record which
    tenant got each, ``n`` times."""
    order = []
    for _ in range(n):
        queue.release(holder)
        await settle()
        done = [(t, task) for t, task in tasks if task.done()]
        assert len(done) == 1, "one release admits exactly one waiter"
        holder = done[0][0]
        order.append(holder)
        tasks.remove(done[0])
    return order


def test_backlogged_tenants_share_slots_by_weight():
    async def run():
        queue = FairQueue(Slots(1))
        await queue.acquire("warm")  # holds the only slot
        tasks = await backlog(queue, {"heavy": (1.0, 30), "light": (3.0, 30)})
        order = await drain(queue, tasks, 20, "warm")
        for task in tasks:
            task[1].cancel()
        return order

    order = asyncio.run(run())
    assert order.count("light") == 15 and order.count("heavy") == 5
    for i in range(0, 20, 4):  # in every 4 admissions: 3 light, 1 heavy
        assert order[i : i + 4].count("light") == 3


def test_a_late_light_tenant_overtakes_a_long_heavy_backlog():
    async def run():
        queue = FairQueue(Slots(1))
        await queue.acquire("heavy")
        tasks = await backlog(queue, {"heavy": (1.0, 40)})
        tasks += await backlog(queue, {"light": (1.0, 4)})
        order = await drain(queue, tasks, 12, "heavy")
        for task in tasks:
            task[1].cancel()
        return order

    order = asyncio.run(run())
    # alternates as soon as light arrives: it never waits behind the 40 queued before it
    assert [i for i, t in enumerate(order) if t == "light"] == [0, 2, 4, 6]


def test_the_heavy_tenant_gets_every_slot_the_light_one_leaves_free():
    async def run():
        queue = FairQueue(Slots(4))
        got = [await queue.acquire("heavy") for _ in range(4)]  # no wait: slots are free
        tasks = await backlog(queue, {"heavy": (1.0, 6), "light": (1.0, 1)})
        order = await drain(queue, tasks, 7, "heavy")
        return got, order, queue.depth()

    got, order, left = asyncio.run(run())
    assert got == [1, 2, 3, 4]
    assert order.count("heavy") == 6 and order.count("light") == 1 and left == 0


def test_an_idle_tenant_gets_no_credit_for_its_idle_time():
    async def run():
        queue = FairQueue(Slots(1))
        for _ in range(10):  # light alone: it uses every slot
            await queue.acquire("light")
            queue.release("light")
        await queue.acquire("light")
        tasks = await backlog(queue, {"light": (1.0, 6), "heavy": (1.0, 6)})
        order = await drain(queue, tasks, 8, "light")
        for task in tasks:
            task[1].cancel()
        return order

    order = asyncio.run(run())
    assert order.count("heavy") == 4  # an even split from now, not a light-first debt


def test_a_tenant_over_its_cap_is_refused_and_others_are_not():
    async def run():
        queue = FairQueue(Slots(1), max_waiting=3)
        await queue.acquire("a")
        tasks = await backlog(queue, {"a": (1.0, 3)})
        with pytest.raises(QueueFull):
            await queue.acquire("a")
        other = asyncio.ensure_future(queue.acquire("b"))
        await settle()
        depths = queue.depth("a"), queue.depth("b")
        for _, task in [*tasks, ("b", other)]:
            task.cancel()
        await settle()
        return depths, queue.depth()

    assert asyncio.run(run()) == ((3, 1), 0)


def test_a_request_waiting_past_the_timeout_leaves_the_queue():
    async def run():
        queue = FairQueue(Slots(1), timeout=0.05)
        await queue.acquire("a")
        with pytest.raises(QueueTimeout):
            await queue.acquire("b")
        return queue.depth(), queue.active

    assert asyncio.run(run()) == (0, 1)


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_its_slot():
    async def run():
        queue = FairQueue(Slots(1))
        await queue.acquire("a")
        gone = asyncio.ensure_future(queue.acquire("b"))
        stays = asyncio.ensure_future(queue.acquire("c"))
        await settle()
        gone.cancel()
        await settle()
        depth = queue.depth()
        queue.release("a")
        await settle()
        return depth, gone.cancelled(), stays.result(), queue.active, queue.depth()

    assert asyncio.run(run()) == (1, True, 2, 1, 0)


def test_a_slot_handed_to_a_waiter_that_is_cancelled_passes_on():
    async def run():
        queue = FairQueue(Slots(1))
        await queue.acquire("a")
        first = asyncio.ensure_future(queue.acquire("b"))
        second = asyncio.ensure_future(queue.acquire("c"))
        await settle()
        queue.release("a")  # the slot goes to b's future...
        first.cancel()  # ...but b gives up before it runs again
        await settle()
        return second.done(), queue.active

    assert asyncio.run(run()) == (True, 1)


def test_more_capacity_admits_waiters_without_a_release():
    async def run():
        slots = Slots(1)
        queue = FairQueue(slots)
        await queue.acquire("a")
        waiting = asyncio.ensure_future(queue.acquire("b"))
        await settle()
        slots.n = 2  # a pod came back: the periodic re-check sees it
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(run()) == 2


def test_many_abandoned_waiters_do_not_pile_up_in_the_heap():
    async def run():
        queue = FairQueue(Slots(1))
        await queue.acquire("a")
        for round in range(5):
            names = [f"t{round}-{i}" for i in range(100)]  # new names every round
            tasks = [asyncio.ensure_future(queue.acquire(name)) for name in names]
            await settle()
            for task in tasks:
                task.cancel()
            await settle()
        return len(queue._heap), len(queue._finish)

    heap, finish = asyncio.run(run())
    assert heap <= 100 and finish <= 4 * 100 + 64 + 1


def test_reserve_slots_start_a_tenant_under_its_share_at_once_and_only_it():
    async def run():
        queue = FairQueue(Slots(4), reserve=lambda: 1)
        for _ in range(4):
            await queue.acquire("heavy")
        more_heavy = asyncio.ensure_future(queue.acquire("heavy"))
        await settle()
        light = await asyncio.wait_for(queue.acquire("light"), 5)  # a reserve slot
        second_light = asyncio.ensure_future(queue.acquire("light"))
        await settle()
        state = more_heavy.done(), second_light.done(), queue.active
        queue.release("heavy")  # a normal slot frees: the light waiter's tag is older
        await settle()
        state += (second_light.done(), more_heavy.done())
        more_heavy.cancel()
        return light, state

    light, state = asyncio.run(run())
    assert light == 5
    # heavy is over its share: no reserve slot for it; the reserve is full for light
    assert state == (False, False, 5, True, False)


def test_held_slots_and_shares_are_forgotten_when_a_tenant_is_done():
    async def run():
        queue = FairQueue(Slots(2))
        await queue.acquire("a")
        await queue.acquire("b")
        queue.release("a")
        queue.release("b")
        return queue.active, queue._held, queue._weight

    assert asyncio.run(run()) == (0, {}, {})


def test_random_arrivals_cancels_and_releases_keep_the_books_straight():
    import random

    async def run():
        rng = random.Random(7)
        slots = Slots(3)
        queue = FairQueue(slots, max_waiting=5, reserve=lambda: 1)
        holders: list[tuple[str, asyncio.Future]] = []
        waiting: list[tuple[str, asyncio.Future]] = []
        for _ in range(600):
            action = rng.random()
            if action < 0.45:
                tenant = rng.choice(["a", "b", "c"])
                weight = {"a": 1.0, "b": 2.0, "c": 0.5}[tenant]
                if queue.depth(tenant) < 5:
                    waiting.append((tenant, asyncio.ensure_future(queue.acquire(tenant, weight))))
            elif action < 0.75 and holders:
                tenant, _ = holders.pop(rng.randrange(len(holders)))
                queue.release(tenant)
            elif action < 0.85 and waiting:
                waiting.pop(rng.randrange(len(waiting)))[1].cancel()
            elif action < 0.9:
                slots.n = rng.randint(1, 4)
                queue.poke()
            await settle()
            holders += [(t, f) for t, f in waiting if f.done() and not f.cancelled()]
            waiting = [(t, f) for t, f in waiting if not f.done()]
            queue.check_integrity()
        for _, future in waiting:
            future.cancel()
        await settle()
        queue.check_integrity()
        return queue.admissions

    assert asyncio.run(run()) > 100
