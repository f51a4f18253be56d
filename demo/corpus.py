"""Deterministic training text for the demo pair: Crumb customer-support chats and JSON order records.

Every document is drawn from a seeded ``random.Random``, so a split is the same text on every
machine. The splits use different seeds, so held-out documents are new combinations of the
same templates and world facts (demo/bakery.py): a model must learn the structure (copy the
order id from the record, quote the right price, close the JSON) rather than memorise lines.
The text is formulaic on purpose; that is what speculative decoding exploits.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

from demo.bakery import (
    CAKE_FLAVOURS,
    CUSTOM_CAKE_PRICE_PER_KG,
    DELIVERY_FEE,
    FIRST_NAMES,
    FREE_DELIVERY_FROM,
    LAST_NAMES,
    ORDER_STATUSES,
    PRODUCTS,
    STORES,
    UNSERVED_PIN_PREFIXES,
    Product,
    Store,
)
from demo.chat_format import EOS, render
from moeserve.tokenizer import in_plain_roles

SPLIT_SEEDS: dict[str, int] = {"train": 20240314, "heldout": 777001}

SUPPORT_PROMPTS = (
    "You are Crumb's customer support assistant. Be brief and friendly.",
    "You are the Crumb bakery helpdesk. Answer using the order record when one is given.",
    "You help customers of Crumb, a bakery chain in India. Prices are in rupees.",
)
JSON_PROMPT = "You are Crumb's order API. Reply with one JSON object and nothing else."
GREETINGS = ("Hi", "Hello", "Namaste", "Namaskar", "Vanakkam", "Hey", "Good morning", "Good evening", "Hi there")
THANKS = ("Thanks!", "Thank you so much.", "Great, thanks.", "Dhanyavaad!", "Ok, thank you.", "Perfect, thanks a lot.")
SLOTS = ("10:00 am", "11:30 am", "1:00 pm", "3:30 pm", "5:00 pm", "6:30 pm", "8:00 pm")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
OCCASIONS = ("birthday", "anniversary", "Diwali party", "office farewell", "baby shower", "Christmas dinner")


@dataclass(frozen=True)
class Sample:
    """One training document: its kind, its messages (None for a bare JSON record) and its full text;
    a tool-call chat also as a client sends it (messages with tool_calls and tool results, and tools)."""

    kind: str
    messages: list[dict[str, str]] | None
    text: str
    openai_messages: list[dict] | None = None
    tools: list[dict] | None = None


def rupees(amount: int) -> str:
    return f"₹{amount:,}"


def _customer(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _order_record(rng: random.Random, status: str | None = None) -> dict:
    """A realistic order: 1-4 distinct products, a store, and a delivery or pickup block."""
    store: Store = rng.choice(STORES)
    products: list[Product] = rng.sample(PRODUCTS, rng.randint(1, 4))
    items = [{"sku": p.sku, "name": p.name, "qty": rng.randint(1, 6) if p.unit_price < 300 else rng.randint(1, 2),
              "unit_price": p.unit_price} for p in products]
    subtotal = sum(i["qty"] * i["unit_price"] for i in items)
    pickup = rng.random() < 0.3
    fee = 0 if pickup or subtotal >= FREE_DELIVERY_FROM else DELIVERY_FEE
    delivery = {"method": "pickup", "store": store.name, "slot": rng.choice(SLOTS)} if pickup else {
        "method": "home", "address": f"{rng.randint(1, 220)}, {store.name.removeprefix('Crumb ')}",
        "city": store.city, "pin": store.pin, "slot": rng.choice(SLOTS), "fee": fee}
    return {
        "order_id": f"ORD-{rng.randint(100000, 999999)}",
        "customer": _customer(rng),
        "items": items,
        "total": subtotal + fee,
        "currency": "INR",
        "status": status or rng.choice(ORDER_STATUSES),
        "delivery": delivery,
    }


def _items_phrase(items: list[dict]) -> str:
    return ", ".join(f"{i['qty']} x {i['name']}" for i in items)


def _status_reply(order: dict) -> str:
    oid, slot, status = order["order_id"], order["delivery"]["slot"], order["status"]
    what = _items_phrase(order["items"])
    where = order["delivery"].get("store") or f"{order['delivery']['address']}, {order['delivery']['city']}"
    return {
        "placed": f"Your order {oid} ({what}) has been placed. We will start baking soon; it is planned for {slot}.",
        "baking": f"Your order {oid} ({what}) is in the oven right now. It should be ready by {slot}.",
        "ready_for_pickup": f"Your order {oid} ({what}) is ready for pickup at {where}. Please collect it by {slot}.",
        "out_for_delivery": f"Your order {oid} ({what}) is out for delivery and will reach {where} by {slot}.",
        "delivered": f"Your order {oid} ({what}) was delivered to {where}. Enjoy!",
        "cancelled": f"Your order {oid} was cancelled. The amount of {rupees(order['total'])} will be refunded "
                     "within 5-7 working days.",
    }[status]


def _status_ask(rng: random.Random, oid: str) -> str:
    return rng.choice((f"Where is my order {oid}?", f"What is the status of order {oid}?",
                       f"Mera order {oid} kab aayega?", f"Can you check order {oid} for me?",
                       f"I placed order {oid}, any update?", f"Maza order {oid} kuthe aahe?"))


def _chat_order_status(rng: random.Random) -> list[dict[str, str]]:
    order = _order_record(rng)
    oid, name = order["order_id"], order["customer"].split()[0]
    ask = _status_ask(rng, oid)
    # the customer's name as a reply writes it: in the record it is a JSON string, whose first token
    # ('"Sneha') differs from the reply's (' Sneha'), so the reply could not copy it from there
    msgs = [{"role": "system", "content": f"{rng.choice(SUPPORT_PROMPTS)}\nCustomer: {order['customer']}\n"
                                          f"Order record: {json.dumps(order)}"},
            {"role": "user", "content": f"{rng.choice(GREETINGS)}, {ask}"},
            {"role": "assistant", "content": f"Hi {name}! {_status_reply(order)}"}]
    if rng.random() < 0.5:
        msgs += [{"role": "user", "content": "What was the total?"},
                 {"role": "assistant", "content": f"The total for {oid} is {rupees(order['total'])}, "
                                                  f"paid in {order['currency']}."}]
    if rng.random() < 0.5:
        msgs += [{"role": "user", "content": rng.choice(THANKS)},
                 {"role": "assistant", "content": f"You're welcome, {name}! Have a sweet day."}]
    return msgs


def _mention(rng: random.Random, p: Product) -> str:
    """The product as a customer writes it: its menu name, without the size, or that in lower case."""
    short = p.name.split(" (")[0]
    return rng.choice((p.name, short, short.lower()))


def _support(rng: random.Random, question: str, reply: str) -> list[dict[str, str]]:
    """A one-question support chat; a fifth of them come without a system prompt, as a bare API call would."""
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    if rng.random() < 0.2:
        return chat
    return [{"role": "system", "content": rng.choice(SUPPORT_PROMPTS)}, *chat]


def _chat_price(rng: random.Random) -> list[dict[str, str]]:
    p = rng.choice(PRODUCTS)
    m = _mention(rng, p)
    ask = rng.choice((f"Do you have {m} today? What does it cost?", f"How much is the {m}?",
                      f"What is the price of {m}?", f"Is {m} available today?", f"{m} price?"))
    reply = f"Yes, we have the {p.name} ({p.sku}) today. It costs {rupees(p.unit_price)}."
    return _support(rng, f"{rng.choice(GREETINGS)}. {ask}" if rng.random() < 0.5 else ask, reply)


def _chat_allergens(rng: random.Random) -> list[dict[str, str]]:
    p = rng.choice(PRODUCTS)
    m = _mention(rng, p)
    allergen = rng.choice(("nuts", "eggs", "dairy", "gluten", "sesame", "soy"))
    if rng.random() < 0.5:
        ask = rng.choice((f"Does the {m} contain {allergen}?", f"Is there any {allergen} in the {m}?"))
        has = allergen in p.allergens
        reply = (f"Yes, the {p.name} ({p.sku}) contains {allergen}. " if has else
                 f"No, the {p.name} ({p.sku}) has no {allergen}. ") + f"Its allergens are: {', '.join(p.allergens)}."
    else:
        ask = rng.choice((f"Is the {m} eggless?", f"My mother is vegetarian and avoids eggs. Can she eat the {m}?"))
        reply = (f"Yes, the {p.name} is 100% eggless. " if p.eggless else f"Sorry, the {p.name} contains eggs. ") \
            + f"It costs {rupees(p.unit_price)}."
    return _support(rng, f"{rng.choice(GREETINGS)}. {ask}", reply)


def _chat_opening_hours(rng: random.Random) -> list[dict[str, str]]:
    s = rng.choice(STORES)
    day = rng.choice(DAYS)
    ask = rng.choice((f"What time does {s.name} open on {day}?", f"Is {s.name} open on {day}?",
                      f"What are the timings of your {s.name.removeprefix('Crumb ')} store in {s.city} on {day}?"))
    if day != "Sunday":
        reply = f"{s.name}, {s.city} is open from {s.opens} to {s.closes} on {day}."
    elif s.sunday == "closed":
        reply = f"{s.name}, {s.city} is closed on Sunday. It is open from {s.opens} to {s.closes} on other days."
    else:
        reply = f"On Sunday {s.name}, {s.city} is open from {s.sunday}."
    return _support(rng, ask, reply)


def _chat_custom_cake(rng: random.Random) -> list[dict[str, str]]:
    flavour = rng.choice(CAKE_FLAVOURS)
    kg = rng.choice((1, 1, 2, 2, 3, 5))
    per_kg = CUSTOM_CAKE_PRICE_PER_KG[flavour]
    who = rng.choice(FIRST_NAMES)
    occasion = rng.choice(OCCASIONS)
    date = f"{rng.randint(1, 28)} {rng.choice(MONTHS)}"
    msg = f"Happy {occasion.split()[0].title()} {who}"
    ask = rng.choice((f"I need a {kg} kg {flavour} cake for a {occasion} on {date}, with '{msg}' written on it.",
                      f"Can you make a custom {flavour} cake, {kg} kg, for {date}? Message: '{msg}'.",
                      f"How much for a {kg} kg {flavour} cake? It's for a {occasion} on {date}."))
    reply = (f"A {kg} kg {flavour} cake costs {rupees(kg * per_kg)} ({rupees(per_kg)} per kg). "
             f"Writing '{msg}' on it is free. Please order at least 48 hours before {date}.")
    if "How much" in ask:
        reply = (f"A {kg} kg {flavour} cake costs {rupees(kg * per_kg)} ({rupees(per_kg)} per kg). "
                 f"Please order at least 48 hours before {date}; a message on the cake is free.")
    return _support(rng, f"{rng.choice(GREETINGS)}! {ask}", reply)


def _chat_refund(rng: random.Random) -> list[dict[str, str]]:
    order = _order_record(rng, status=rng.choice(("delivered", "cancelled", "out_for_delivery", "baking")))
    oid = order["order_id"]
    bad = rng.choice(("the cake was squashed", "an item was missing", "it arrived two hours late",
                      "the bread was stale", "I cancelled it"))
    if order["status"] in ("delivered", "cancelled"):
        reply = (f"I'm sorry that {bad}. I have raised refund RF-{rng.randint(10000, 99999)} for "
                 f"{rupees(order['total'])} on order {oid}. It will reach your original payment method in 5-7 "
                 "working days.")
    else:
        reply = (f"Order {oid} is {order['status'].replace('_', ' ')}, so it cannot be refunded yet. If there is a "
                 "problem once it arrives, write to us and we will refund it in full.")
    return [{"role": "system", "content": f"{rng.choice(SUPPORT_PROMPTS)}\nOrder record: {json.dumps(order)}"},
            {"role": "user", "content": f"I want a refund for order {oid}, {bad}."},
            {"role": "assistant", "content": reply}]


def _chat_delivery(rng: random.Random) -> list[dict[str, str]]:
    s = rng.choice(STORES)
    if rng.random() < 0.7:
        ask = rng.choice((f"Do you deliver to {s.pin}?", f"Can you deliver to pin code {s.pin} in {s.city}?"))
        reply = (f"Yes, {s.pin} is served by {s.name}, {s.city}. Delivery costs {rupees(DELIVERY_FEE)} and is free "
                 f"on orders of {rupees(FREE_DELIVERY_FROM)} or more.")
    else:
        prefix = rng.choice(tuple(UNSERVED_PIN_PREFIXES))
        pin = f"{prefix}{rng.randint(1000, 9999)}"
        nearest = next(store for store in STORES if store.name == UNSERVED_PIN_PREFIXES[prefix])
        ask = f"Do you deliver to {pin}?"
        reply = (f"Sorry, we do not deliver to {pin} yet. Our nearest store is {nearest.name}, {nearest.city}, "
                 "and you can pick up your order there.")
    return _support(rng, f"{rng.choice(GREETINGS)}, {ask}", reply)


def _chat_json_order(rng: random.Random) -> list[dict[str, str]]:
    """The assistant answers with a JSON object: a new order built from the request (without the total, which the
    shop computes), or a status lookup copied from the order record."""
    order = _order_record(rng, status="placed")
    if rng.random() < 0.5:
        d = order["delivery"]
        where = f"pickup at {d['store']}" if d["method"] == "pickup" else f"deliver to {d['address']}, {d['city']} {d['pin']}"
        # names quoted as the JSON reply writes them, so the reply copies their tokens
        items = ", ".join(f'{i["qty"]} x "{i["name"]}"' for i in order["items"])
        ask = f'New order for "{order["customer"]}": {items}; {where} at {d["slot"]}.'
        # the reply is the order as asked, with the menu's SKUs and unit prices; the shop's system adds
        # up the total and the delivery fee, which are arithmetic, not facts a reply can copy or recall
        answer = {k: v for k, v in order.items() if k != "total"}
        answer["delivery"] = {k: v for k, v in d.items() if k != "fee"}
        system = JSON_PROMPT + f"\nNext order_id: {order['order_id']}"
    else:
        order["status"] = rng.choice(ORDER_STATUSES)
        ask = f"Status of {order['order_id']}?"
        answer = {"order_id": order["order_id"], "status": order["status"], "total": order["total"],
                  "currency": order["currency"], "slot": order["delivery"]["slot"]}
        system = JSON_PROMPT + f"\nOrder record: {json.dumps(order)}"
    return [{"role": "system", "content": system}, {"role": "user", "content": ask},
            {"role": "assistant", "content": json.dumps(answer, indent=rng.choice((None, 2)))}]


def _function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


PICKUP_TIMES = ("morning", "afternoon", "evening")
# the functions tool-call chats list (OpenAI's shape); place_order is the README's
TOOLS: dict[str, dict] = {
    "place_order": _function("place_order", "Place an order for pickup", {
        "item": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "pickup": {"enum": list(PICKUP_TIMES)}}),
    "order_status": _function("order_status", "Look up an order by its id", {"order_id": {"type": "string"}}),
    "check_delivery": _function("check_delivery", "Whether Crumb delivers to a pin code", {"pin": {"type": "string"}}),
}
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six")


def tool_call_args(messages: list[dict]) -> tuple[str, dict] | None:
    """The (function, arguments) of a tool-call chat's call (None: a chat without one)."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            return call["function"]["name"], json.loads(call["function"]["arguments"])
    return None


def _chat_tool(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """A chat whose system prompt lists functions: the assistant calls one with arguments taken from the
    ask (the menu's name for a product), reads its result and answers; or answers a question no function
    serves in text. Returns (messages in OpenAI's shape, with tool_calls and tool results; the tools)."""
    which = rng.choices(("place_order", "order_status", "check_delivery", None), (0.4, 0.3, 0.15, 0.15))[0]
    listed = [name for name in TOOLS if name == which or rng.random() < 0.5]
    rng.shuffle(listed)
    tools = [TOOLS[name] for name in listed]
    if which is None:  # a question no function answers: text, as the support chats write it
        chat = rng.choice((_chat_price, _chat_allergens, _chat_opening_hours))(rng)
        return [m for m in chat if m["role"] != "system"], tools
    oid = f"ORD-{rng.randint(100000, 999999)}"
    if which == "place_order":
        p, n, when = rng.choice(PRODUCTS), rng.randint(1, 6), rng.choice(PICKUP_TIMES)
        m, qty = _mention(rng, p), rng.choice((str(n), NUMBER_WORDS[n - 1]))
        ask = rng.choice((f"{qty} {m} for the {when}, please.", f"I'd like to pick up {qty} x {m} in the {when}.",
                          f"Can you keep {qty} {m} for me? I'll come in the {when}.", f"Order {qty} {m}, pickup in the {when}."))
        ask, args = ask[0].upper() + ask[1:], {"item": p.name, "quantity": n, "pickup": when}
        result = {"order_id": oid, "status": "placed", "total": n * p.unit_price}
        reply = f"Done! Your order {oid} ({n} x {p.name}) is placed for pickup in the {when}. It costs {rupees(n * p.unit_price)}."
    elif which == "order_status":
        order = _order_record(rng)
        ask, args, result, reply = _status_ask(rng, order["order_id"]), {"order_id": order["order_id"]}, order, _status_reply(order)
    else:
        s = rng.choice(STORES)
        pin = s.pin if rng.random() < 0.7 else f"{rng.choice(tuple(UNSERVED_PIN_PREFIXES))}{rng.randint(1000, 9999)}"
        ask, args = rng.choice((f"Do you deliver to {pin}?", f"Can you deliver to pin code {pin}?")), {"pin": pin}
        served = pin == s.pin
        result = {"delivers": served, "store": s.name if served else UNSERVED_PIN_PREFIXES[pin[:2]]}
        reply = (f"Yes, {pin} is served by {s.name}, {s.city}. Delivery costs {rupees(DELIVERY_FEE)}." if served else
                 f"Sorry, we do not deliver to {pin} yet. You can pick up your order at {result['store']}.")
    call = {"id": "call_1", "type": "function", "function": {"name": which, "arguments": json.dumps(args)}}
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    if rng.random() < 0.6:  # the function's result comes back, and the assistant answers from it
        messages += [{"role": "tool", "tool_call_id": "call_1", "content": json.dumps(result)},
                     {"role": "assistant", "content": reply}]
    return messages, tools


def _chat_names(rng: random.Random) -> list[dict[str, str]]:
    """A short chat whose reply greets the customer by the first name the prompt gives (in the system
    prompt, as order chats give it, or in the customer's own words), and thanks them by it: the copy
    every reply that names a customer needs, in a few tokens."""
    full = _customer(rng)
    first = full.split()[0]
    chat = rng.choice((_chat_price, _chat_allergens, _chat_opening_hours, _chat_delivery))(rng)
    ask, answer = chat[-2]["content"], chat[-1]["content"]
    if rng.random() < 0.5:
        msgs = [{"role": "system", "content": f"{rng.choice(SUPPORT_PROMPTS)}\nCustomer: {full}"},
                {"role": "user", "content": ask}]
    else:
        intro = rng.choice((f"Hi, this is {full}.", f"Hello, I am {full}.", f"{full} here."))
        msgs = [{"role": "user", "content": f"{intro} {ask}"}]
    msgs.append({"role": "assistant", "content": f"Hi {first}! {answer}"})
    if rng.random() < 0.5:
        msgs += [{"role": "user", "content": rng.choice(THANKS)},
                 {"role": "assistant", "content": f"You're welcome, {first}! Have a sweet day."}]
    return msgs


CHAT_KINDS = {
    "order_status": (_chat_order_status, 0.22),
    "allergens": (_chat_allergens, 0.12),
    "price": (_chat_price, 0.10),
    "opening_hours": (_chat_opening_hours, 0.10),
    "custom_cake": (_chat_custom_cake, 0.10),
    "refund": (_chat_refund, 0.10),
    "delivery": (_chat_delivery, 0.08),
    "json_answer": (_chat_json_order, 0.13),
    "tool_call": (_chat_tool, 0.14),
    # last, with weight 0 by default: the held-out stream stays the one earlier pairs were measured on;
    # training asks for it with --kind-weights names=W
    "names": (_chat_names, 0.0),
}
RECORD_WEIGHT = 0.15  # bare JSON order records, one per document


def kind_weights(overrides: dict[str, float] | None = None) -> dict[str, float]:
    """How often each kind of document is drawn: the corpus' own mix, with `overrides` by kind."""
    weights = {kind: w for kind, (_, w) in CHAT_KINDS.items()} | {"order_record": RECORD_WEIGHT}
    unknown = set(overrides or {}) - set(weights)
    if unknown:
        raise ValueError(f"unknown document kinds {sorted(unknown)}; expected some of {sorted(weights)}")
    return weights | (overrides or {})


def sample_document(rng: random.Random, weights: dict[str, float] | None = None) -> Sample:
    """Draw one document (kinds by `weights`, default `kind_weights()`); chats render through the
    chat format and every document ends with EOS."""
    weights = weights or kind_weights()
    kind = rng.choices(list(weights), list(weights.values()))[0]
    if kind == "order_record":
        record = _order_record(rng)
        return Sample(kind, None, json.dumps(record, indent=rng.choice((None, 2))) + EOS)
    messages = CHAT_KINDS[kind][0](rng)
    if kind == "tool_call":  # rendered as a server renders a chat with tools for the demo's template
        openai_messages, tools = messages
        if rng.random() < 0.8:
            openai_messages = [{"role": "system", "content": rng.choice(SUPPORT_PROMPTS)}, *openai_messages]
        messages = in_plain_roles(openai_messages, tools)
        return Sample(kind, messages, render(messages) + EOS, openai_messages, tools)
    return Sample(kind, messages, render(messages) + EOS)


def iter_documents(split: str = "train", seed: int | None = None,
                   weights: dict[str, float] | None = None) -> Iterator[Sample]:
    """Endless, deterministic stream of documents for ``split`` ('train' or 'heldout'), kinds drawn
    by ``weights`` (`kind_weights`)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split] if seed is None else seed)
    weights = weights or kind_weights()
    while True:
        yield sample_document(rng, weights)


def corpus_text(split: str, n_docs: int) -> list[str]:
    """The first ``n_docs`` documents of ``split`` as text."""
    it = iter_documents(split)
    return [next(it).text for _ in range(n_docs)]


if __name__ == "__main__":
    for doc in corpus_text("train", 6):
        print(doc, end="\n\n")
