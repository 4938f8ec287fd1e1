"""The API's routes, one `APIRouter` per concern; `coordinator.service.api` assembles them."""
