"""The API's routes, one `APIRouter` per concern; `coordinator.service.rest.api` assembles them."""
