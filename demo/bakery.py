"""The world of Crumb, the bakery chain the demo corpus is about: products, stores, customers.

These facts are fixed (not sampled), so prices, allergens and opening hours stay consistent
across the train and held-out splits; a model can learn them, and a reply that quotes them
can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    unit_price: int  # whole rupees; Crumb prices never carry paise
    allergens: tuple[str, ...]
    eggless: bool


PRODUCTS: tuple[Product, ...] = (
    Product("CRB-101", "Eggless chocolate cake (1 kg)", 950, ("gluten", "dairy", "soy"), True),
    Product("CRB-102", "Black forest cake (500 g)", 550, ("gluten", "dairy", "eggs"), False),
    Product("CRB-103", "Red velvet cake (1 kg)", 1100, ("gluten", "dairy", "eggs"), False),
    Product("CRB-104", "Mango cheesecake (750 g)", 890, ("gluten", "dairy", "eggs"), False),
    Product("CRB-105", "Plum cake (750 g)", 680, ("gluten", "eggs", "nuts"), False),
    Product("CRB-106", "Mawa cake", 180, ("gluten", "dairy", "eggs", "nuts"), False),
    Product("CRB-201", "Sourdough loaf", 240, ("gluten",), True),
    Product("CRB-202", "Multigrain bread", 85, ("gluten", "sesame"), True),
    Product("CRB-203", "Pav (pack of 6)", 45, ("gluten", "dairy"), True),
    Product("CRB-204", "Garlic focaccia", 210, ("gluten",), True),
    Product("CRB-301", "Butter croissant", 90, ("gluten", "dairy", "eggs"), False),
    Product("CRB-302", "Almond croissant", 130, ("gluten", "dairy", "eggs", "nuts"), False),
    Product("CRB-303", "Masala bun", 40, ("gluten", "dairy"), True),
    Product("CRB-304", "Paneer puff", 60, ("gluten", "dairy"), True),
    Product("CRB-305", "Red velvet cupcake", 110, ("gluten", "dairy", "eggs"), False),
    Product("CRB-401", "Kaju katli (500 g)", 620, ("nuts", "dairy"), True),
    Product("CRB-402", "Motichoor ladoo (500 g)", 380, ("dairy",), True),
    Product("CRB-403", "Nankhatai (250 g)", 160, ("gluten", "dairy"), True),
    Product("CRB-404", "Shrewsbury biscuits (200 g)", 220, ("gluten", "dairy", "eggs"), False),
    Product("CRB-405", "Coconut macaroons (250 g)", 190, ("eggs",), False),
)


@dataclass(frozen=True)
class Store:
    name: str
    city: str
    pin: str
    opens: str
    closes: str
    sunday: str


STORES: tuple[Store, ...] = (
    Store("Crumb Koregaon Park", "Pune", "411001", "8:00 am", "10:00 pm", "9:00 am to 9:00 pm"),
    Store("Crumb Kothrud", "Pune", "411038", "7:30 am", "9:30 pm", "8:00 am to 9:00 pm"),
    Store("Crumb Bandra West", "Mumbai", "400050", "8:00 am", "11:00 pm", "8:00 am to 11:00 pm"),
    Store("Crumb Dadar", "Mumbai", "400014", "7:00 am", "10:00 pm", "closed"),
    Store("Crumb Indiranagar", "Bengaluru", "560038", "8:30 am", "10:30 pm", "9:00 am to 10:00 pm"),
    Store("Crumb Jayanagar", "Bengaluru", "560041", "8:00 am", "9:00 pm", "8:00 am to 1:00 pm"),
    Store("Crumb Hauz Khas", "Delhi", "110016", "9:00 am", "11:00 pm", "9:00 am to 11:00 pm"),
    Store("Crumb Banjara Hills", "Hyderabad", "500034", "8:00 am", "10:00 pm", "10:00 am to 8:00 pm"),
    Store("Crumb Adyar", "Chennai", "600020", "7:00 am", "9:30 pm", "7:00 am to 12:30 pm"),
    Store("Crumb Park Street", "Kolkata", "700016", "9:00 am", "10:00 pm", "9:00 am to 10:00 pm"),
)

# pin codes Crumb does not deliver to, by their first two digits, and the store nearest to them
UNSERVED_PIN_PREFIXES: dict[str, str] = {
    "12": "Crumb Hauz Khas", "38": "Crumb Bandra West", "45": "Crumb Kothrud", "68": "Crumb Adyar",
    "80": "Crumb Park Street",
}

FIRST_NAMES: tuple[str, ...] = (
    "Meera", "Arjun", "Priya", "Ravi", "Aditi", "Rohan", "Sneha", "Vikram", "Ananya", "Kabir",
    "Lakshmi", "Karthik", "Divya", "Suresh", "Fatima", "Imran", "Sunita", "Rahul", "Pooja", "Anil",
    "Nandini", "Siddharth", "Kavya", "Farhan", "Gurpreet", "Harleen", "Tanvi", "Omkar", "Shreya", "Joseph",
    "Maria", "Aarav", "Ishita", "Manoj", "Bhavna", "Deepak", "Swati", "Naveen", "Zoya", "Sanjay",
)
LAST_NAMES: tuple[str, ...] = (
    "Kulkarni", "Nair", "Sharma", "Iyer", "Deshpande", "Reddy", "Banerjee", "Singh", "Khan", "Patil",
    "Menon", "Joshi", "Gupta", "Chatterjee", "Rao", "Fernandes", "Mehta", "Pillai", "Das", "Shaikh",
    "Gill", "Bose", "Kapoor", "Naidu", "Verma", "D'Souza", "Pawar", "Krishnan", "Sethi", "Ghosh",
)

ORDER_STATUSES: tuple[str, ...] = ("placed", "baking", "ready_for_pickup", "out_for_delivery", "delivered", "cancelled")
CAKE_FLAVOURS: tuple[str, ...] = (
    "chocolate truffle", "butterscotch", "pineapple", "rasmalai", "mango", "red velvet",
    "coffee walnut", "vanilla", "blueberry", "gulab jamun",
)
CUSTOM_CAKE_PRICE_PER_KG: dict[str, int] = {
    "chocolate truffle": 1200, "butterscotch": 900, "pineapple": 850, "rasmalai": 1400, "mango": 1100,
    "red velvet": 1300, "coffee walnut": 1250, "vanilla": 800, "blueberry": 1350, "gulab jamun": 1450,
}
DELIVERY_FEE = 49
FREE_DELIVERY_FROM = 999
